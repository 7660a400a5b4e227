"""A CPU limit per simulated node: a cgroup whose CFS quota is a given number of CPUs.

A straggler on a real cluster is often a node that computes slower (a
throttled or older GPU, a noisy neighbour). On the testbed a node is given
less CPU the way a container is: its agent and every worker it starts run in
a cgroup of the cpu controller with ``quota = cpus x period`` (cgroup v1's
``cpu.cfs_quota_us``, or v2's ``cpu.max``), so the kernel lets it run only
that share of each 10 ms period, whatever its threads do.

A node's agent joins its cgroup before it starts any worker: every worker
(forked from it) runs under the limit from its first instruction, so no child
escapes it, while the agent's start-up (importing torch), which is not the
node's compute, is not throttled (at a quarter CPU it took about 12 s). An
agent forked with torch imported joins at once, before it enters its node
(:mod:`hybrid.runtime.netns`). One started as a command under the node's
prefix (``python -m hybrid.runtime.agent``, e.g. a node brought back by
hand) joins once its interpreter has started and imported torch and the entry
point; it runs in a network namespace, whose ``/sys`` has no cgroups, so
:func:`deferred_join_prefix` opens the cgroup's ``cgroup.procs`` before the
namespace is entered and hands the open file down; the agent writes its pid
into it with :func:`join_deferred`. :func:`join_prefix` puts a whole command
inside from the start. Names carry the
creating process id, like the testbed's namespaces; :func:`cleanup_leftovers`
removes those of processes that are gone.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

__all__ = ["CpuLimitError", "cgroup_root", "cleanup_leftovers", "create", "deferred_join_prefix", "join_deferred",
           "join_prefix", "remove"]

# A short period spreads the throttling evenly over a step: with the kernel's default 100 ms a node at a quarter
# CPU runs 25 ms flat out and then stalls 75 ms, so a step of a few ms is either unhurt or stalled whole.
PERIOD_US = 10_000
_V1 = Path("/sys/fs/cgroup/cpu")
_V2 = Path("/sys/fs/cgroup")
_NAME = re.compile(r"^hybrid-(\d+)-n(\d+)$")


class CpuLimitError(RuntimeError):
    """The cpu controller cannot be used here, or a cgroup could not be made; the message says which."""


def cgroup_root() -> tuple[Path, int]:
    """Where cpu cgroups are made here and the cgroup version; CpuLimitError if neither v1 nor v2 has cpu."""
    if (_V1 / "cpu.cfs_quota_us").exists() and os.access(_V1, os.W_OK):
        return _V1, 1
    # v2: a child gets cpu.max only where the parent hands the controller down (cgroup.subtree_control).
    subtree = _V2 / "cgroup.subtree_control"
    if subtree.exists() and "cpu" in subtree.read_text().split() and os.access(_V2, os.W_OK):
        return _V2, 2
    raise CpuLimitError("cluster.testbed.cpu_quota needs a writable cgroup cpu controller (cgroup v1 "
                        f"{_V1} or v2 {_V2} with cpu in cgroup.subtree_control); none here")


def create(node: int, cpus: float) -> Path:
    """A cgroup for ``node`` of this process, limited to ``cpus`` CPUs; returns its directory."""
    root, version = cgroup_root()
    path = root / f"hybrid-{os.getpid()}-n{node}"
    quota = max(1000, round(cpus * PERIOD_US))  # the kernel's minimum quota is 1 ms (0.1 CPU at this period)
    try:
        path.mkdir(exist_ok=True)
        if version == 1:
            (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
    except OSError as exc:
        raise CpuLimitError(f"cannot limit node {node} to {cpus:g} CPUs in {path}: {exc}") from exc
    return path


_JOIN_FD = 9
_JOIN_FD_VARIABLE = "HYBRID_CGROUP_FD"


def deferred_join_prefix(path: Path) -> tuple[str, ...]:
    """A command prefix that opens cgroup ``path``'s ``cgroup.procs`` for the command, which joins the cgroup
    when it calls :func:`join_deferred` (also from inside a network namespace)."""
    script = f'exec {_JOIN_FD}>"$0/cgroup.procs" && export {_JOIN_FD_VARIABLE}={_JOIN_FD} && exec "$@"'
    return ("sh", "-c", script, str(path))


def join_deferred() -> bool:
    """Move this process (all its threads) into the cgroup a :func:`deferred_join_prefix` opened for it, if any;
    whatever it starts from now on is inside too. Returns whether it joined one."""
    fd = os.environ.pop(_JOIN_FD_VARIABLE, None)
    if fd is None:
        return False
    try:
        os.write(int(fd), str(os.getpid()).encode())
    finally:
        os.close(int(fd))
    return True


def join_prefix(path: Path) -> tuple[str, ...]:
    """A command prefix that runs the rest of the command inside cgroup ``path`` (it and all it starts)."""
    return ("sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(path))


def remove(path: Path, timeout_s: float = 10.0) -> None:
    """Remove cgroup ``path``, first moving out any process still in it (rmdir needs it empty)."""
    if not path.exists():
        return
    parent_procs = path.parent / "cgroup.procs"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    parent_procs.write_text(pid)
                except OSError:
                    pass  # gone meanwhile
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # left for cleanup_leftovers; never fail a run's teardown over it
            time.sleep(0.05)


def cleanup_leftovers() -> list[str]:
    """Remove cgroups of testbeds whose creating process is gone; return their names."""
    try:
        root, _ = cgroup_root()
    except CpuLimitError:
        return []
    removed = []
    for path in root.iterdir():
        m = _NAME.match(path.name)
        if m and path.is_dir() and not Path(f"/proc/{m.group(1)}").exists():
            remove(path)
            removed.append(path.name)
    return removed
