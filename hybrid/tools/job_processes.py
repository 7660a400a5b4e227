"""The process tree of a local hybrid job, and a lost node's agent started again: what the recovery benchmarks
(python -m hybrid.bench ft) and experiments (experiments/recovery: kill_a_node.py, soak.py, every_mode.py) share."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

__all__ = ["busy", "name", "start_again", "tree", "under"]


def tree() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    return children


def under(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every descendant of ``pid`` (in ``children``, default: read now)."""
    children, out, todo = children or tree(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def name(pid: int) -> str:
    """A process's name (hybrid names its agents hybrid-agent-N and its workers hybrid-rank-R)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def start_again(node: int, agent: int, world: int, testbed_of: int | None = None,
                base_env: Mapping[str, str] | None = None, **popen: object) -> subprocess.Popen:
    """Node ``node``'s agent, started again the way the launcher started it (its job folder found by the pid file
    each agent writes, holding the lost agent's pid ``agent``). ``testbed_of``: the pid of the job whose testbed
    the node is in (as root: its agent runs in the node's namespace, on its NIC). ``base_env``: the environment
    it starts from (default: this process's), the agent's own variables added."""
    from hybrid.runtime.launch import local_agent_env

    pid_file = next(p for p in Path(tempfile.gettempdir()).glob(f"hybrid-job-*/agent-{node}.pid")
                    if p.read_text() == str(agent))
    inside = ["ip", "netns", "exec", f"hybrid-{testbed_of}-n{node}"] if testbed_of is not None else []
    return subprocess.Popen([*inside, sys.executable, "-m", "hybrid.runtime.agent", str(pid_file.parent), str(node)],
                            env={**(os.environ if base_env is None else base_env), **local_agent_env(world),
                                 "GLOO_SOCKET_IFNAME": "nic0" if testbed_of is not None else "lo"},
                            start_new_session=True, **popen)


@contextmanager
def busy(enabled: bool = True) -> Iterator[None]:
    """One CPU-bound process per core beside what runs inside (where ``enabled``): a cluster node is rarely quiet."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)] \
        if enabled else []
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
