"""A real multi-node network on one Linux machine: nodes as network namespaces on shaped links.

Each simulated node is a network namespace with K "NICs" (``nic0`` ..
``nic{K-1}``, one end of a veth pair each) whose other ends are attached to a
bridge in the root namespace (the switch). Both ends are shaped with
``tc ... tbf``, so traffic between nodes crosses a real bandwidth limit (one
rate per node: a degraded node is one rate lower), while traffic between
workers of one node stays on that namespace's local path (fast, like NVLink in
spirit). NIC k of every node sits in its own /24 (``10.213.(57+k).0``): a
rail, as on GPU clusters where NIC k of each node talks to NIC k of the others.
The workers' gloo binds to every NIC (``GLOO_SOCKET_IFNAME=nic0,nic1``: gloo
opens one device per name and takes them in turn, collective by collective)
and the ranks meet through a c10d rendezvous on node 0's ``nic0`` address:
the same code path as a real cluster, with no emulation in the training code.

Safety: addresses come from private /24s used only inside namespaces this
module creates; the bridge has no address and no uplink, so nothing can leave
them. Every namespace, veth and bridge is removed on exit (also on an
exception, Ctrl-C or SIGTERM); names carry the creating process id, so a
leftover from a killed run is recognised and removed by the next one.

With ``cpus``, each node also runs in a cgroup limited to that many CPUs
(:mod:`hybrid.runtime.cpu_limit`): a node that computes slower.

Needs iproute2 (``ip``, ``tc``) and either root or unprivileged user namespaces. Without root the whole
testbed lives inside one user namespace of its own (``unshare --user --map-root-user --net --mount``, the
same call as ``unshare -rnm``): there this process's user is root over a network namespace that stands in
for the machine's (the bridge lives in it) and a mount namespace where ``/run`` (for ``ip netns``) and
``/etc/hosts`` are the testbed's. A holder process keeps the namespaces alive and every command enters
them with ``nsenter``; the holder reads its stdin until this process is gone, so everything the testbed
made disappears with it, even after a SIGKILL. CPU limits (cgroups) still need root.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Callable, Sequence

from hybrid.runtime import cpu_limit
from hybrid.runtime.netns import NETNS_ETC, NodeEntry, NodeNetwork

__all__ = ["MAX_NICS", "LinkShape", "Testbed", "TestbedError", "cleanup_leftovers", "nic_address", "nic_names",
           "owned_namespaces", "per_node_cpus", "per_node_rates", "process_alive", "reshape_running",
           "testbed_available", "testbed_forks_agents"]

MAX_NICS = 8


# The service namespace's address (on the nic0 rail, above every node's): where an elastic job's rendezvous store
# runs, off the training nodes.
SERVICE_ADDRESS = "10.213.57.254"


def nic_address(node: int, nic: int) -> str:
    """NIC ``nic`` of node ``node``: 10.213.(57 + nic).(node + 1), a /24 per NIC index (a rail)."""
    return f"10.213.{57 + nic}.{node + 1}"


def _per_node(values: object, nnodes: int, valid: Callable[[float], bool], one: str, many: str) -> list[float]:
    """One number per node from one for every node or a list of one per node, each ``valid``; ValueError
    naming the value and the rule (``one``: what one number must be; ``many``: their plural) otherwise."""
    listed = list(values) if isinstance(values, (list, tuple)) else [values]
    if (len(listed) not in (1, nnodes)
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and valid(v) for v in listed)):
        raise ValueError(f"{values!r} must be {one} or a list of {nnodes} such {many}, one per node")
    return [float(v) for v in listed] * (nnodes if len(listed) == 1 else 1)


def per_node_rates(rates: float | Sequence[float], nnodes: int) -> list[float]:
    """One link rate (Mbit/s) per node from one rate for all or a list of one per node; ValueError otherwise."""
    return _per_node(rates, nnodes, lambda r: r > 0, "a rate > 0 (Mbit/s)", "rates")


def per_node_cpus(cpus: float | Sequence[float], nnodes: int) -> list[float]:
    """One CPU limit per node (:mod:`hybrid.runtime.cpu_limit`) from one for all or a list of one per node."""
    limit = os.cpu_count() or 1
    return _per_node(cpus, nnodes, lambda c: 0.1 <= c <= limit,
                     f"a number of CPUs in 0.1..{limit} (this machine's)", "numbers")


def nic_tx_bytes(ifname: str) -> int:
    """Bytes ``ifname`` has transmitted, from this network namespace's ``/proc/net/dev``."""
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == ifname:
            return int(fields.split()[8])
    raise ValueError(f"network interface {ifname!r} not found in /proc/net/dev")


def testbed_nics() -> list[str]:
    """The NICs of the testbed node this process runs on (the ones gloo is bound to); empty outside one."""
    return [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]


def nic_names(nics: int) -> list[str]:
    """The NICs of a node, as named inside its namespace: nic0, nic1, ..."""
    return [f"nic{k}" for k in range(nics)]

_NS = re.compile(r"^hybrid-(\d+)-(n\d+|rdzv)$")
_BRIDGE = re.compile(r"^hyb(\d+)br$")


class TestbedError(RuntimeError):
    """The testbed cannot be built here, or a command failed; the message says which."""


def testbed_available() -> str | None:
    """None if a testbed can be built here (as root, or in a user namespace of its own), else the reason."""
    tools = ("ip", "tc") if os.geteuid() == 0 else ("ip", "tc", "unshare", "nsenter")
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        return f"the network testbed needs {', '.join(missing)} (iproute2, util-linux): not found"
    if os.geteuid() != 0:
        return _user_namespaces_refused()
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"network namespaces are not available: {probe.stderr.strip()}"
    return None


USERNS = ("unshare", "--user", "--map-root-user", "--net", "--mount")


def testbed_forks_agents() -> bool:
    """Whether a testbed made by this process has its agents forked from the launch's fork server (as root it
    enters its nodes itself; in a user namespace a command prefix must start each agent)."""
    return os.geteuid() == 0


def _user_namespaces_refused() -> str | None:
    """None if this user may make a user namespace with network and mount namespaces, else what is needed."""
    try:
        probe = subprocess.run([*USERNS, "true"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        probe = subprocess.CompletedProcess(USERNS, 1, "", str(exc))
    if probe.returncode == 0:
        return None
    said = (probe.stderr.strip().splitlines() or [f"exit {probe.returncode}"])[0]
    return (f"the network testbed needs root or unprivileged user namespaces (running as uid {os.geteuid()}, "
            f"`unshare -rnm` failed: {said}); as root, allow them (`sysctl -w user.max_user_namespaces=15000`, "
            "and kernel.unprivileged_userns_clone=1 on Debian kernels or "
            "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu's), or run as root")


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise TestbedError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (also one of another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_namespaces() -> list[tuple[str, int]]:
    """Every testbed namespace on this machine, with the pid of the process that made it."""
    return _ours()[0]


def _ours() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    namespaces = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if m := _NS.match(name):
            namespaces.append((name, int(m.group(1))))
    bridges = []
    for line in _run("ip", "-o", "link", "show", "type", "bridge").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if m := _BRIDGE.match(name):
            bridges.append((name, int(m.group(1))))
    return namespaces, bridges


# Entering a node (``ip netns exec NS``, hybrid.runtime.netns.enter) mounts /etc/netns/NS/hosts over /etc/hosts:
# a hosts file per namespace that names every node's addresses. Without it a reverse lookup of a peer's address
# (c10d does one for every store connection) goes to a DNS server no namespace can reach and fails with
# EAI_AGAIN, which c10d logged as "[c10d] The hostname of the client socket cannot be retrieved. err=-3", once
# per connection.
def _hosts_file(addresses: dict[str, str]) -> str:
    """Loopback and every node address, also as the IPv4-mapped IPv6 address a dual-stack socket reports."""
    lines = ["127.0.0.1 localhost", "::1 localhost"]
    lines += [f"{prefix}{address} {name}" for address, name in addresses.items() for prefix in ("", "::ffff:")]
    return "\n".join(lines) + "\n"


def cleanup_leftovers() -> list[str]:
    """Remove namespaces and bridges of testbeds whose creating process is gone; return their names."""
    namespaces, bridges = _ours()
    removed = []
    for name, pid in namespaces:
        if not process_alive(pid):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
            removed.append(name)
    for folder in NETNS_ETC.glob("hybrid-*") if NETNS_ETC.is_dir() else ():
        if (m := _NS.match(folder.name)) and not process_alive(int(m.group(1))):
            shutil.rmtree(folder, ignore_errors=True)
    for name, pid in bridges:
        if not process_alive(pid):
            subprocess.run(["ip", "link", "delete", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


def reshape_running(owner: int, mbit: Sequence[float], burst_kb: float = 0.0, latency_ms: float = 50.0) -> list[str]:
    """Reshape, from another shell, the links of the testbed that process ``owner`` built (a job's
    ``python -m hybrid.train``): node i's NICs to ``mbit[i]`` Mbit/s (one rate: every node). As root only: a
    testbed in a user namespace is reachable only from its maker. Returns the interfaces changed."""
    namespaces = sorted((int(m.group(1)), name) for name, pid in owned_namespaces() if pid == owner
                        and (m := re.fullmatch(rf"hybrid-{owner}-n(\d+)", name)))
    if not namespaces:
        raise TestbedError(f"no testbed of process {owner} here (ip netns list): is its job running, as root?")
    rates = list(mbit) * len(namespaces) if len(mbit) == 1 else list(mbit)
    if len(rates) != len(namespaces):
        raise TestbedError(f"{len(mbit)} rates for a testbed of {len(namespaces)} nodes: give one, or one per node")
    host_ends = [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-o", "link", "show").splitlines()]
    changed = []
    for (i, ns), rate in zip(namespaces, rates):
        link = LinkShape(rate, burst_kb, latency_ms)
        for host_end in (h for h in host_ends if re.fullmatch(rf"hyb{owner}n{i}[a-z]?", h)):
            _run("tc", "qdisc", "change", "dev", host_end, "root", *link.tbf_args())
            changed.append(host_end)
        nics = [line.split(":")[1].strip().split("@")[0] for line in _run("ip", "-n", ns, "-o", "link", "show").splitlines()]
        for nic in (n for n in nics if re.fullmatch(r"nic\d+", n)):
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", nic, "root", *link.tbf_args())
            changed.append(f"{ns}/{nic}")
    return changed


@dataclass(frozen=True)
class LinkShape:
    """A token-bucket limit on each node's NIC, in both directions."""

    rate_mbit: float
    burst_kb: float = 0.0  # 0: enough for one 4 ms timer tick at the rate, at least 64 KB
    latency_ms: float = 50.0  # how long a packet may queue before tbf drops it

    def __post_init__(self) -> None:
        if not self.rate_mbit > 0:
            raise ValueError(f"link_mbit={self.rate_mbit} must be > 0")
        if self.burst_kb < 0 or not self.latency_ms > 0:
            raise ValueError(f"burst_kb={self.burst_kb} must be >= 0 and latency_ms={self.latency_ms} > 0")

    @property
    def bucket_kb(self) -> float:
        """tbf's bucket: what a NIC may send at line speed after a pause, on top of the rate (a transfer
        of B bytes may so run at up to 1 + bucket / B of the rate)."""
        return self.burst_kb or max(64.0, self.rate_mbit * 1e6 / 8 * 0.004 / 1024)

    def tbf_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", f"{self.bucket_kb:.0f}kb", "latency",
                f"{self.latency_ms:g}ms"]


class _UserNamespace:
    """A user namespace (root inside) with its own network and mount namespaces, held by a child process.

    ``prefix`` runs a command inside them. The holder (``cat``) lives until its stdin closes: at
    :meth:`close`, or when the process that made it dies in any way."""

    READY_TIMEOUT_S = 30.0

    def __init__(self) -> None:
        self.holder = subprocess.Popen([*USERNS, "--fork", "sh", "-c", "echo ready && exec cat >/dev/null"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, start_new_session=True)
        ready, _, _ = select.select([self.holder.stdout], [], [], self.READY_TIMEOUT_S)
        line = self.holder.stdout.readline() if ready else ""
        if line.strip() != "ready":
            try:  # its stdout closed (an empty line): it is exiting; let it end, so that its message is whole
                self.holder.wait(timeout=5 if ready else 0.1)
            except subprocess.TimeoutExpired:
                pass
            ended = self.holder.poll() is not None
            said = (self.holder.stderr.read().strip().splitlines() or ["no message"])[0] if ended else "no answer"
            self.close()  # the reason is read first: close() closes the holder's pipes
            raise TestbedError(f"`{' '.join(USERNS)}` did not start a testbed namespace within "
                               f"{self.READY_TIMEOUT_S:.0f} s: {said}")
        self.prefix: tuple[str, ...] = ("nsenter", f"--target={self.holder.pid}", "--user", "--net", "--mount",
                                         "--preserve-credentials")  # setgroups is denied in the namespace

    def close(self) -> None:
        if self.holder.stdin and not self.holder.stdin.closed:
            self.holder.stdin.close()
        try:
            self.holder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.holder.kill()
            self.holder.wait(timeout=10)
        for stream in (self.holder.stdout, self.holder.stderr):
            if stream:
                stream.close()


class Testbed:
    """``with Testbed(2, LinkShape(500)) as tb: launch_local(layout, fn, nodes=tb.nodes)``.

    ``link``: one shape for every node, or one per node (node i's NICs all get ``link[i]``);
    ``nics_per_node``: K NICs per node, each shaped on its own; ``cpus``: CPUs per node (a cgroup's quota), or
    None for no limit."""

    __test__ = False  # not a pytest test class, despite the name

    def __init__(self, nnodes: int, link: LinkShape | Sequence[LinkShape], nics_per_node: int = 1,
                 cpus: Sequence[float] | None = None) -> None:
        if not 1 <= nnodes <= 200:
            raise ValueError(f"testbed nnodes={nnodes} must be in 1..200")
        if not 1 <= nics_per_node <= MAX_NICS:
            raise ValueError(f"testbed nics_per_node={nics_per_node} must be in 1..{MAX_NICS}")
        links = [link] * nnodes if isinstance(link, LinkShape) else list(link)
        if len(links) != nnodes:
            raise ValueError(f"testbed link_mbit has {len(links)} rates for {nnodes} nodes: give one, or one per node")
        if cpus is not None and len(cpus) != nnodes:
            raise ValueError(f"testbed cpu_quota has {len(cpus)} values for {nnodes} nodes: give one per node")
        self.nnodes, self.links, self.nics_per_node, self.cpus = nnodes, links, nics_per_node, cpus
        self.cgroups: list[Path] = []
        pid = os.getpid()
        self.bridge = f"hyb{pid}br"
        self.namespaces = [f"hybrid-{pid}-n{i}" for i in range(nnodes)]
        # A namespace that is no training node, on the same switch, unshaped: the rendezvous store's (elastic jobs).
        self.service_namespace, self._service_end = f"hybrid-{pid}-rdzv", f"hyb{pid}r"
        # Interface names have at most 15 characters: nic 0 keeps the plain name, nic k > 0 a letter.
        self._host_ends = [[f"hyb{pid}n{i}" + ("" if k == 0 else chr(ord("a") + k)) for k in range(nics_per_node)]
                           for i in range(nnodes)]
        self._previous_sigterm: object = None
        self._userns: _UserNamespace | None = None
        self._etc: Path | None = None  # the hosts file of a user-namespace testbed

    @property
    def prefix(self) -> tuple[str, ...]:
        """What runs a command in the testbed's root network namespace (the switch's): nothing as root, else
        ``nsenter`` into its user namespace. ``(*bed.prefix, "ip", "netns", "exec", ns, ...)`` reaches a node."""
        # Entering a mount namespace moves to its root directory: --wd keeps the caller's working directory.
        return (*self._userns.prefix, f"--wd={os.getcwd()}") if self._userns else ()

    def _run(self, *cmd: str) -> str:
        return _run(*self.prefix, *cmd)

    @property
    def nodes(self) -> list[NodeNetwork]:
        ifnames = ",".join(nic_names(self.nics_per_node))
        # A command under the prefix joins its node's cgroup once it has started (cpu_limit.join_deferred): its
        # workers are throttled, its interpreter's start-up is not. A process forked as root enters the node
        # itself (hybrid.runtime.netns), cgroup first; in a user namespace only the prefix can reach a node.
        limits = [cpu_limit.deferred_join_prefix(path) for path in self.cgroups] or [()] * self.nnodes
        cgroups = [str(path) for path in self.cgroups] or [""] * self.nnodes
        return [NodeNetwork(nic_address(i, 0), ifnames, (*limit, *self.prefix, "ip", "netns", "exec", ns),
                            NodeEntry(ns, cgroup) if testbed_forks_agents() else None)
                for i, (ns, limit, cgroup) in enumerate(zip(self.namespaces, limits, cgroups))]

    @property
    def service(self) -> NodeNetwork:
        """The namespace beside the nodes that is none of them (where an elastic job's rendezvous store runs)."""
        return NodeNetwork(SERVICE_ADDRESS, "nic0", (*self.prefix, "ip", "netns", "exec", self.service_namespace))

    def __enter__(self) -> "Testbed":
        reason = testbed_available()
        if reason:
            raise TestbedError(reason)
        if os.geteuid() == 0:
            cleanup_leftovers()  # without root nothing can be left over: a testbed dies with its namespace
            cpu_limit.cleanup_leftovers()
        elif self.cpus is not None:
            raise TestbedError(f"cluster.testbed.cpu_quota needs root: cgroups cannot be made by uid {os.geteuid()} "
                               "(the testbed itself runs in a user namespace; its CPU limits do not)")
        self._trap_sigterm()
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.destroy()

    def _create(self) -> None:
        if self.cpus is not None:
            try:
                for i, c in enumerate(self.cpus):
                    self.cgroups.append(cpu_limit.create(i, c))  # one by one: destroy() removes those made
            except cpu_limit.CpuLimitError as exc:
                raise TestbedError(str(exc)) from exc
        names = {nic_address(i, k): f"hybrid-n{i}" + (f"-nic{k}" if k else "")
                 for i in range(self.nnodes) for k in range(self.nics_per_node)}
        names[SERVICE_ADDRESS] = "hybrid-rdzv"
        if os.geteuid() != 0:
            # One hosts file for every node, over /etc/hosts in the namespace's own mounts; /run a tmpfs of its
            # own, where ``ip netns`` keeps its namespaces (the machine's /run is not this user's to write).
            self._userns = _UserNamespace()
            self._etc = Path(tempfile.mkdtemp(prefix="hybrid-testbed-"))
            (self._etc / "hosts").write_text(_hosts_file(names))
            # The hosts file first: it may sit under /run (TMPDIR=/run/user/UID), which the tmpfs then covers.
            self._run("mount", "--bind", str(self._etc / "hosts"), "/etc/hosts")
            self._run("mount", "-t", "tmpfs", "-o", "mode=755", "hybrid-run", "/run")
        self._run("ip", "link", "add", self.bridge, "type", "bridge")
        self._run("ip", "link", "set", self.bridge, "up")
        for i, (ns, host_ends, link) in enumerate(zip(self.namespaces, self._host_ends, self.links)):
            if self._userns is None:
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)  # before the namespace: destroy() removes both
                (NETNS_ETC / ns / "hosts").write_text(_hosts_file(names))
            self._run("ip", "netns", "add", ns)
            self._run("ip", "-n", ns, "link", "set", "lo", "up")
            if self.nics_per_node > 1:
                # A multi-homed host: answer ARP only on the NIC that holds the address, and announce from it,
                # or a peer may learn nic0's MAC for nic1's address and send both NICs' traffic through one.
                self._run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.conf.all.arp_ignore=1",
                     "net.ipv4.conf.all.arp_announce=2")
            for k, (nic, host_end) in enumerate(zip(nic_names(self.nics_per_node), host_ends)):
                self._run("ip", "link", "add", host_end, "type", "veth", "peer", "name", nic, "netns", ns)
                self._run("ip", "link", "set", host_end, "master", self.bridge)
                self._run("ip", "link", "set", host_end, "up")
                self._run("ip", "-n", ns, "addr", "add", f"{nic_address(i, k)}/24", "dev", nic)
                self._run("ip", "-n", ns, "link", "set", nic, "up")
                # Egress of the host end is the node's download; egress of the NIC its upload.
                self._run("tc", "qdisc", "add", "dev", host_end, "root", *link.tbf_args())
                self._run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", nic, "root", *link.tbf_args())
        self._create_service(names)

    def reshape(self, mbit: Sequence[float]) -> None:
        """Give node i's NICs ``mbit[i]`` Mbit/s, both ways, while a job runs on them (``tc qdisc change``: the
        shaper's rate changes in place, no connection drops). Burst and queue limit stay as built."""
        if len(mbit) != self.nnodes:
            raise ValueError(f"reshape: {len(mbit)} rates for {self.nnodes} nodes: give one per node")
        links = [LinkShape(rate, link.burst_kb, link.latency_ms) for rate, link in zip(mbit, self.links)]
        for ns, host_ends, link in zip(self.namespaces, self._host_ends, links):
            for nic, host_end in zip(nic_names(self.nics_per_node), host_ends):
                self._run("tc", "qdisc", "change", "dev", host_end, "root", *link.tbf_args())
                self._run("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", nic, "root", *link.tbf_args())
        self.links = links

    def sent_bytes(self) -> list[int]:
        """Bytes each node has sent through its NICs so far: what the switch's ends of its veths received (read
        in the switch's namespace, where a program outside the nodes counts a job's inter-node traffic)."""
        received: dict[str, int] = {}
        for line in self._run("cat", "/proc/net/dev").splitlines()[2:]:
            name, _, fields = line.partition(":")
            received[name.strip()] = int(fields.split()[0])
        return [sum(received[end] for end in ends) for ends in self._host_ends]

    def _create_service(self, names: dict[str, str]) -> None:
        """The service namespace: one unshaped NIC on the switch at SERVICE_ADDRESS."""
        ns, host_end = self.service_namespace, self._service_end
        if self._userns is None:
            (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / ns / "hosts").write_text(_hosts_file(names))
        self._run("ip", "netns", "add", ns)
        self._run("ip", "-n", ns, "link", "set", "lo", "up")
        self._run("ip", "link", "add", host_end, "type", "veth", "peer", "name", "nic0", "netns", ns)
        self._run("ip", "link", "set", host_end, "master", self.bridge)
        self._run("ip", "link", "set", host_end, "up")
        self._run("ip", "-n", ns, "addr", "add", f"{SERVICE_ADDRESS}/24", "dev", "nic0")
        self._run("ip", "-n", ns, "link", "set", "nic0", "up")

    def destroy(self) -> None:
        """Remove everything this testbed created (deleting a namespace deletes its veth pair)."""
        if os.geteuid() != 0:  # the namespaces, links and mounts go with the user namespace's last process
            if self._userns is not None:
                self._userns.close()
                self._userns = None
            if self._etc is not None:
                shutil.rmtree(self._etc, ignore_errors=True)
            self._restore_sigterm()
            return
        for ns in [*self.namespaces, self.service_namespace]:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        for host_end in [*(name for ends in self._host_ends for name in ends), self._service_end]:
            subprocess.run(["ip", "link", "delete", host_end], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30)
        for path in self.cgroups:
            cpu_limit.remove(path)
        self._restore_sigterm()

    def _trap_sigterm(self) -> None:
        # SIGTERM's default action skips `finally` blocks; turn it into SystemExit so
        # __exit__ runs. Only the main thread may install handlers.
        try:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)
        except ValueError:
            self._previous_sigterm = None

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)  # type: ignore[arg-type]
            self._previous_sigterm = None


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
