"""A real Slurm cluster on the network testbed: munge, slurmctld, and one slurmd per node namespace.

Each testbed node (:mod:`hybrid.runtime.testbed`: a network namespace with a shaped NIC) also gets a UTS
namespace and a mount namespace of its own, so that to Slurm and to torch it is a separate host: its
``hostname`` is its Slurm node name (``hybrid-n0`` ...), its ``/etc/hosts`` names every node, and the
slurmd started inside it forks every job step (slurmstepd, the job's tasks, their workers) inside it too.
slurmctld runs in the testbed's service namespace (``hybrid-rdzv``, 10.213.57.254), beside the nodes and
unshaped. munged runs in the machine's namespaces: its socket is a file, and the namespaces share the file
system. The switch (the testbed's bridge) gets one more address, :data:`LOGIN_ADDRESS`, so that this machine
is the cluster's login host: ``sbatch``, ``srun``, ``squeue`` and ``scontrol`` reach slurmctld from here.

What the testbed leaves out of a production slurm.conf, and why:
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroup hierarchy to set up per
node; a step's processes are found by parentage), ``AccountingStorageType=accounting_storage/none`` (no
slurmdbd and database: ``sacct`` says accounting is disabled, and job states come from slurmctld's records,
kept ``MinJobAge`` seconds; :mod:`hybrid.app.slurm_launcher` reads them there), and short timers
(a requeued job may start again after ``cred_expire`` = 5 s instead of 120 s; the scheduler looks every
2 s; a slurmd silent for 10 s is DOWN). Everything else is Slurm's own behaviour.

Needs root (the daemons run as root; namespaces and munge's key file owner) and Debian's ``slurmctld``,
``slurmd``, ``slurm-client`` and ``munge`` packages (Slurm 22.05 was tried). Nothing here downloads.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hybrid.runtime import cpu_limit
from hybrid.runtime.testbed import SERVICE_ADDRESS, LinkShape, Testbed, TestbedError, nic_address

__all__ = ["CONF_HEADER", "LOGIN_ADDRESS", "NODE_PREFIX", "SlurmCluster", "SlurmSpec", "kill_namespace", "node_name", "slurm_conf",
           "slurm_missing"]

LOGIN_ADDRESS = "10.213.57.253"  # the switch's own address: this machine, as the cluster's login host
CONTROLLER = "hybrid-rdzv"  # the service namespace's name in the testbed's hosts files
NODE_PREFIX = "hybrid-n"
PARTITION = "hybrid"
CONF_HEADER = "# Written by python -m hybrid.testbed slurm up; removed by slurm down."
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")
INSTALL = "apt-get install slurmctld slurmd slurm-client munge"


def node_name(i: int) -> str:
    """Slurm's name for testbed node ``i``: the same name the testbed's hosts files give its address."""
    return f"{NODE_PREFIX}{i}"


def slurm_missing() -> str | None:
    """None if a Slurm testbed can run here, else why not (one line)."""
    if os.geteuid() != 0:
        return f"the Slurm testbed needs root (running as uid {os.geteuid()}): its daemons and namespaces are root's"
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        return f"the Slurm testbed needs {', '.join(missing)}: not found (Debian: {INSTALL})"
    return None


@dataclass(frozen=True)
class SlurmSpec:
    """The cluster to build: ``nodes`` testbed nodes with ``cores`` CPUs each (what Slurm schedules; a
    ``cpu_quota`` also limits what a node computes, as the testbed's cgroups do) on ``link_mbit`` links."""

    nodes: int
    cores: int
    link_mbit: float
    base: Path  # every file the cluster writes: config, munge's key and socket, state, spool, logs
    cpu_quota: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ValueError(f"--nodes {self.nodes}: a Slurm testbed has 1..64 nodes")
        if not 1 <= self.cores <= 1024:
            raise ValueError(f"--cores {self.cores}: CPUs per node must be in 1..1024")
        LinkShape(self.link_mbit)  # its own one-line refusal

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket.2"


def slurm_conf(spec: SlurmSpec) -> str:
    """slurm.conf for ``spec``: a controller on the service address, one node per testbed namespace."""
    b = spec.base
    lines = [
        CONF_HEADER,
        "ClusterName=hybrid",
        f"SlurmctldHost={CONTROLLER}({SERVICE_ADDRESS})",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # A requeued job may start again once its old credentials have expired: 5 s, not Slurm's 120.
        f"AuthInfo=socket={spec.munge_socket},cred_expire=5",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={b / 'state'}",
        f"SlurmdSpoolDir={b / 'spool' / '%n'}",
        f"SlurmctldPidFile={b / 'slurmctld.pid'}",
        f"SlurmdPidFile={b / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={b / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={b / 'log' / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",  # the nodes' CPUs are what this file says, not the machine's
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=2,bf_interval=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={b / 'log' / 'jobcomp.txt'}",
        "MinJobAge=900",  # a finished job stays in slurmctld's records (scontrol show job) for 15 minutes
        "KillWait=10",
        "SlurmdTimeout=10",
        "ReturnToService=2",
        "InactiveLimit=0",
        "MailProg=/bin/true",
    ]
    for i in range(spec.nodes):
        lines.append(f"NodeName={node_name(i)} NodeAddr={nic_address(i, 0)} CPUs={spec.cores} State=UNKNOWN")
    # Whole nodes per job, as on most GPU partitions: two jobs never share a node's cores or NIC.
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE")
    return "\n".join(lines) + "\n"


def _in_host(ns: str, hostname: str) -> tuple[str, ...]:
    """A prefix that runs a command as host ``hostname``: in network namespace ``ns``, with a UTS namespace
    (its hostname) and a mount namespace (the testbed's hosts file over /etc/hosts) of its own. Unlike
    ``ip netns exec`` it keeps the machine's /sys, where slurmd looks for cgroups."""
    hosts = Path("/etc/netns") / ns / "hosts"
    script = f'mount --bind "{hosts}" /etc/hosts && hostname "{hostname}" && exec "$@"'
    return ("nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", script, "sh")


class SlurmCluster:
    """``with SlurmCluster(spec):`` a running cluster (``SLURM_CONF=spec.conf``); everything gone after."""

    READY_TIMEOUT_S = 60.0

    def __init__(self, spec: SlurmSpec) -> None:
        reason = slurm_missing()
        if reason:
            raise TestbedError(reason)
        self.spec = spec
        cpus = [spec.cpu_quota] * spec.nodes if spec.cpu_quota else None
        self.bed = Testbed(spec.nodes, LinkShape(spec.link_mbit), cpus=cpus)
        self.daemons: list[subprocess.Popen] = []
        self._logs: list[IO[bytes]] = []

    def __enter__(self) -> SlurmCluster:
        if self.spec.base.exists():
            raise TestbedError(f"{self.spec.base} exists: a Slurm testbed is up (python -m hybrid.testbed slurm "
                               "down ends it) or one was killed (remove the folder)")
        self.bed.__enter__()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.spec.conf)}

    def _start(self) -> None:
        b = self.spec.base
        for sub in ("state", "log", *(f"spool/{node_name(i)}" for i in range(self.spec.nodes))):
            (b / sub).mkdir(parents=True, exist_ok=True)
        self.spec.conf.write_text(slurm_conf(self.spec))
        subprocess.run(["ip", "addr", "add", f"{LOGIN_ADDRESS}/24", "dev", self.bed.bridge], check=True,
                       capture_output=True, timeout=30)
        self._start_munge()
        self._daemon("slurmctld", _in_host(self.bed.service_namespace, CONTROLLER),
                     "slurmctld", "-D", "-f", str(self.spec.conf))
        for i, ns in enumerate(self.bed.namespaces):
            limit = cpu_limit.join_prefix(self.bed.cgroups[i]) if self.bed.cgroups else ()
            self._daemon(f"slurmd-{node_name(i)}", (*limit, *_in_host(ns, node_name(i))),
                         "slurmd", "-D", "-N", node_name(i), "-f", str(self.spec.conf))
        self._wait_idle()

    def _start_munge(self) -> None:
        folder = self.spec.munge_socket.parent
        folder.mkdir(mode=0o755)
        shutil.chown(folder, "munge", "munge")
        as_munge = ("runuser", "-u", "munge", "--")
        key = folder / "munge.key"
        subprocess.run([*as_munge, "mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True,
                       timeout=30)
        self._daemon("munged", as_munge, "munged", "--foreground", f"--key-file={key}",
                     f"--socket={self.spec.munge_socket}", f"--pid-file={folder / 'munged.pid'}",
                     f"--log-file={folder / 'munged.log'}", f"--seed-file={folder / 'munged.seed'}")
        deadline = time.monotonic() + 10
        while not self.spec.munge_socket.exists():
            self._check_daemons()
            if time.monotonic() > deadline:
                raise TestbedError(f"munged did not open {self.spec.munge_socket} within 10 s")
            time.sleep(0.1)

    def _daemon(self, name: str, prefix: tuple[str, ...], *cmd: str) -> None:
        log = open(self.spec.base / "log" / f"{name}.out", "wb")  # noqa: SIM115  closed in stop()
        self._logs.append(log)
        proc = subprocess.Popen([*prefix, *cmd], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=self.env)
        proc.name = name  # type: ignore[attr-defined]
        self.daemons.append(proc)

    def _check_daemons(self) -> None:
        for proc in self.daemons:
            if proc.poll() is not None:
                out = (self.spec.base / "log" / f"{proc.name}.out").read_text(errors="replace")  # type: ignore[attr-defined]
                said = [line for line in out.splitlines() if "error" in line.lower()][-1:] or ["no message"]
                raise TestbedError(f"{proc.name} exited with {proc.returncode}: {said[0].strip()}")  # type: ignore[attr-defined]

    def _wait_idle(self) -> None:
        """Until every node is idle in slurmctld's view (its slurmd registered)."""
        deadline = time.monotonic() + self.READY_TIMEOUT_S
        states: list[str] = []
        while time.monotonic() < deadline:
            self._check_daemons()
            done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True,
                                  env=self.env, timeout=30)
            states = sorted(done.stdout.split("\n")) if done.returncode == 0 else [done.stderr.strip()]
            idle = [line for line in states if line.endswith(" idle")]
            if len(idle) == self.spec.nodes:
                return
            time.sleep(0.3)
        raise TestbedError(f"the Slurm nodes were not idle within {self.READY_TIMEOUT_S:.0f} s: "
                           f"{'; '.join(s for s in states if s) or 'no answer from slurmctld'}")

    def stop(self) -> None:
        """Every process of the cluster (the jobs' too), the namespaces, and the cluster's folder."""
        for ns in [*self.bed.namespaces, self.bed.service_namespace]:
            kill_namespace(ns)  # slurmstepd and the jobs' tasks are no children of ours: found by namespace
        for proc in reversed(self.daemons):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for log in self._logs:
            log.close()
        self.bed.destroy()
        shutil.rmtree(self.spec.base, ignore_errors=True)


def kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns`` (if it exists), and wait until none is left."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
        pids = [int(p) for p in listed.stdout.split()] if listed.returncode == 0 else []
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
