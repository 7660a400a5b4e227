"""``python -m hybrid.testbed slurm up|down|status``: a real Slurm cluster on the network testbed, from the shell;
``python -m hybrid.testbed reshape``: a running job's links at another rate.

``slurm up --nodes N`` builds :class:`hybrid.runtime.slurm_cluster.SlurmCluster` in a process of its own
(the cluster's holder, detached from the shell: the namespaces and daemons live as long as it does), waits
until every node is idle, and prints ``export SLURM_CONF=...``. ``slurm down`` ends the holder, which stops
every daemon and job process, removes the namespaces and the cluster's folder, and checks that nothing is
left; it also clears what a killed holder left behind. One Slurm testbed at a time, in ``--dir``.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hybrid.runtime import testbed
from hybrid.runtime.slurm_cluster import CONF_HEADER, LOGIN_ADDRESS, SlurmCluster, SlurmSpec, kill_namespace, slurm_missing

__all__ = ["main"]

DEFAULT_DIR = Path("/run/hybrid-slurm")
HOLDER_PID = "holder.pid"
UP_TIMEOUT_S = 120.0
DOWN_TIMEOUT_S = 60.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid.testbed", description=__doc__.split("\n\n")[0])
    verbs = p.add_subparsers(dest="system", required=True)
    slurm = verbs.add_parser("slurm", help="a Slurm cluster whose nodes are testbed nodes")
    actions = slurm.add_subparsers(dest="action", required=True)
    up = actions.add_parser("up", help="start munge, slurmctld and one slurmd per node; print SLURM_CONF")
    up.add_argument("--nodes", type=int, required=True, help="Slurm nodes, one testbed node each")
    up.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="CPUs Slurm schedules on each node (default: this machine's)")
    up.add_argument("--link-mbit", type=float, default=500.0, help="each node's NIC rate, both ways (Mbit/s)")
    up.add_argument("--cpu-quota", type=float, default=None,
                    help="CPUs each node may use (a cgroup quota, as cluster.testbed.cpu_quota); default: no limit")
    for action in (up, actions.add_parser("down", help="stop everything and remove it"),
                   actions.add_parser("status", help="is one up, and where")):
        action.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cluster's folder ({DEFAULT_DIR})")
    reshape = verbs.add_parser("reshape", help="change the link rates of a running job's testbed (root)",
                               description="Change the NIC rates, both ways, of the testbed that a running "
                               "`python -m hybrid.train cluster.testbed.enabled=true` built, while it trains.")
    reshape.add_argument("--pid", type=int, required=True,
                         help="the job's launcher: the process id in its namespaces' names (ip netns list: hybrid-PID-n0)")
    reshape.add_argument("--link-mbit", type=float, nargs="+", required=True,
                         help="Mbit/s: one rate for every node, or one per node")
    reshape.add_argument("--burst-kb", type=float, default=0.0,
                         help="tbf's burst, as cluster.testbed.burst_kb (0, the default: one 4 ms tick at the rate)")
    reshape.add_argument("--latency-ms", type=float, default=50.0,
                         help="tbf's queue limit, as cluster.testbed.latency_ms (default 50)")
    serve = actions.add_parser("serve", help=argparse.SUPPRESS)  # the holder: slurm up starts it
    serve.add_argument("--dir", type=Path, required=True)
    for name, kind in (("--nodes", int), ("--cores", int), ("--link-mbit", float), ("--cpu-quota", float)):
        serve.add_argument(name, type=kind)
    return p


def _holder(folder: Path) -> int | None:
    """The pid of the live holder of the cluster in ``folder``, if any."""
    try:
        pid = int((folder / HOLDER_PID).read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def _serve(args: argparse.Namespace) -> int:
    """The holder: build the cluster, say ``ready`` (or the error) on stdout, then hold it until SIGTERM."""
    try:
        spec = SlurmSpec(args.nodes, args.cores, args.link_mbit, args.dir.resolve(), args.cpu_quota)
        cluster = SlurmCluster(spec).__enter__()
    except (ValueError, testbed.TestbedError, OSError, subprocess.SubprocessError) as exc:
        print(f"error: {str(exc).strip().splitlines()[0]}", flush=True)
        return 2
    try:
        (spec.base / HOLDER_PID).write_text(str(os.getpid()))
        print("ready", flush=True)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the shell that ran `slurm up` may go; nothing of it is held
            os.dup2(devnull, fd)
        while True:
            signal.pause()  # SIGTERM: SystemExit (the testbed's handler), and the cluster goes
    finally:
        cluster.__exit__(None, None, None)


def _up(args: argparse.Namespace) -> int:
    try:
        SlurmSpec(args.nodes, args.cores, args.link_mbit, args.dir, args.cpu_quota)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if _holder(args.dir) is not None:
        print(f"error: a Slurm testbed is already up in {args.dir} (python -m hybrid.testbed slurm down)",
              file=sys.stderr)
        return 2
    if args.dir.exists():
        if not _ours(args.dir):
            print(f"error: --dir {args.dir} exists and is no Slurm testbed's folder: give a new one", file=sys.stderr)
            return 2
        _clear(args.dir)  # what a killed holder left
    held = subprocess.run(["ip", "-o", "addr", "show", "to", LOGIN_ADDRESS], capture_output=True, text=True, timeout=30)
    if held.stdout.strip():
        print(f"error: {LOGIN_ADDRESS} is held by {held.stdout.split()[1]}: another Slurm testbed is up "
              "(python -m hybrid.testbed slurm status --dir ...)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "hybrid.testbed", "slurm", "serve", "--dir", str(args.dir), "--nodes",
           str(args.nodes), "--cores", str(args.cores), "--link-mbit", str(args.link_mbit)]
    if args.cpu_quota is not None:
        cmd += ["--cpu-quota", str(args.cpu_quota)]
    holder = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    ready, _, _ = select.select([holder.stdout], [], [], UP_TIMEOUT_S)
    line = holder.stdout.readline().strip() if ready else ""  # type: ignore[union-attr]
    holder.stdout.close()  # type: ignore[union-attr]
    if line != "ready":
        if holder.poll() is None:
            holder.terminate()
            holder.wait(timeout=DOWN_TIMEOUT_S)
        print(line if line.startswith("error: ") else
              f"error: the Slurm testbed did not come up within {UP_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 2
    conf = args.dir.resolve() / "slurm.conf"
    print(f"Slurm testbed up: {args.nodes} node(s) hybrid-n0..{args.nodes - 1} x {args.cores} CPUs, "
          f"{args.link_mbit:g} Mbit/s links; controller hybrid-rdzv; holder pid {holder.pid}")
    print(f"export SLURM_CONF={conf}")
    return 0


def _ours(folder: Path) -> bool:
    """Whether ``folder`` is a Slurm testbed's (its holder's pid file, or the slurm.conf it writes): nothing
    else is ever removed."""
    try:
        return (folder / HOLDER_PID).is_file() or (folder / "slurm.conf").read_text().startswith(CONF_HEADER)
    except OSError:
        return False


def _clear(folder: Path) -> None:
    """What a cluster whose holder was killed left: its namespaces' processes, namespaces, munged, folder."""
    try:
        pid = int((folder / HOLDER_PID).read_text())
    except (OSError, ValueError):
        pid = None
    if pid is not None:
        for ns, owner in testbed.owned_namespaces():
            if owner == pid:
                kill_namespace(ns)
        testbed.cleanup_leftovers()
    try:
        os.kill(int((folder / "munge" / "munged.pid").read_text()), signal.SIGTERM)
    except (OSError, ValueError):
        pass
    shutil.rmtree(folder, ignore_errors=True)


def _down(args: argparse.Namespace) -> int:
    pid = _holder(args.dir)
    if pid is None and not args.dir.exists():
        print(f"no Slurm testbed in {args.dir}")
        return 0
    if not _ours(args.dir):
        print(f"error: --dir {args.dir} is no Slurm testbed's folder: nothing stopped or removed", file=sys.stderr)
        return 2
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + DOWN_TIMEOUT_S
        while testbed.process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if testbed.process_alive(pid):
            os.kill(pid, signal.SIGKILL)
    _clear(args.dir)
    print(f"Slurm testbed in {args.dir} is down")
    return 0


def _status(args: argparse.Namespace) -> int:
    pid = _holder(args.dir)
    if pid is None:
        print(f"no Slurm testbed up in {args.dir}")
        return 1
    print(f"Slurm testbed up in {args.dir} (holder pid {pid})")
    print(f"export SLURM_CONF={args.dir.resolve() / 'slurm.conf'}")
    return 0


def _reshape(args: argparse.Namespace) -> int:
    bad = [rate for rate in args.link_mbit if not rate > 0]
    if bad or args.burst_kb < 0 or not args.latency_ms > 0:
        print(f"error: --link-mbit {bad[0]:g} must be > 0 (Mbit/s)" if bad else
              f"error: --burst-kb {args.burst_kb:g} must be >= 0 and --latency-ms {args.latency_ms:g} > 0",
              file=sys.stderr)
        return 2
    try:
        changed = testbed.reshape_running(args.pid, args.link_mbit, args.burst_kb, args.latency_ms)
    except testbed.TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"reshaped {len(changed)} interfaces of process {args.pid}'s testbed to "
          f"{' '.join(f'{r:g}' for r in args.link_mbit)} Mbit/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.system == "reshape":
        return _reshape(args)
    if args.action in ("up", "serve", "down"):
        reason = slurm_missing()
        if reason:
            print(f"error: {reason}", file=sys.stderr)
            return 2
    return {"up": _up, "down": _down, "status": _status, "serve": _serve}[args.action](args)
