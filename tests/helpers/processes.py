"""Processes of a test's jobs: the tree under a pid, a job's agents and workers, leftovers, and
``python -m hybrid.train`` run in the background with its output read line by line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from hybrid.tools.job_processes import name as _name
from hybrid.tools.job_processes import under as descendants

__all__ = ["SESSION_ENV", "SESSION_VAR", "Job", "job_env", "agent_of_node", "agents", "all_gone", "descendants", "hybrid_processes", "left_after",
           "processes_with_marker", "running", "workers"]


# Set by tests/conftest.py for the whole session, so every process the suite starts carries it: the slurm and
# etcd tiers, or another pytest, may run their own sessions meanwhile, and their jobs are not this session's.
SESSION_VAR = "HYBRID_TEST_SESSION"
# The session's environment when it began (tests/conftest.py fills it): what jobs start with, whatever a test
# running beside a background job has monkeypatched meanwhile.
SESSION_ENV: dict[str, str] = {}


def job_env(**extra: str) -> dict[str, str]:
    """The environment for a job's process: the session's as it began (else this process's), and ``extra``."""
    return {**(SESSION_ENV or os.environ), **extra}


def _has_env(pid: int, entry: str) -> bool:
    """Whether process ``pid`` was started with ``entry`` (``NAME=value``) in its environment."""
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def processes_with_marker(marker: str) -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and int(p.name) != os.getpid() and _has_env(int(p.name), f"HYBRID_TEST_MARKER={marker}")]


def left_after(pids_now: Callable[[], list[int]], within_s: float) -> list[int]:
    """``pids_now()`` once it is empty, or when ``within_s`` have passed: processes already killed (and
    multiprocessing's helpers) may take a moment to go, a leak stays."""
    deadline = time.monotonic() + within_s
    while (left := pids_now()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def all_gone(pids: list[int], within_s: float = 10.0) -> bool:
    """Whether every process in ``pids`` has exited, allowing ``within_s`` for ones already killed to go."""
    return left_after(lambda: [p for p in pids if running(p)], within_s) == []


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def agents(root: int) -> list[int]:
    """The elastic agents under ``root``: hybrid names them ``hybrid-agent-NODE`` (a forked agent has its fork
    server's command line, and its forked workers, named ``hybrid-rank-R`` once they run, its own)."""
    return sorted(pid for pid in descendants(root) if _name(pid).startswith("hybrid-agent-")
                  and not _name(_parent(pid) or 0).startswith("hybrid-agent-"))


def agent_of_node(root: int, node: int) -> int:
    """The pid of the elastic agent of ``node`` under ``root``."""
    found = [pid for pid in agents(root) if _name(pid) == f"hybrid-agent-{node}"]
    assert len(found) == 1, found
    return found[0]


def forks_of(root: int) -> list[int]:
    """The children of ``root`` that run its own command line and are not named by hybrid: what it forked rather
    than started (its agents' fork server, when forked from ``python -m hybrid.train``)."""
    return sorted(pid for pid, parent in ((p, _parent(p)) for p in descendants(root)) if parent == root
                  and _argv(pid) == _argv(root) and not _name(pid).startswith("hybrid-"))


def hybrid_processes() -> list[int]:
    """Every agent and worker of a hybrid job that this test session started, by name, orphans included: they
    keep the session's environment (``SESSION_VAR``), which another session's jobs do not have."""
    session = f"{SESSION_VAR}={os.environ[SESSION_VAR]}"
    return sorted(int(p.name) for p in Path("/proc").iterdir()
                  if p.name.isdigit() and _name(int(p.name)).startswith(("hybrid-agent-", "hybrid-rank-"))
                  and _has_env(int(p.name), session))


def workers(root: int) -> list[int]:
    """The training processes under ``root``: the children of its elastic agents (forked or spawned), not
    multiprocessing's resource tracker."""
    mine = set(agents(root))
    found = [pid for pid in descendants(root)
             if _parent(pid) in mine and not any(b"resource_tracker" in a for a in _argv(pid))]
    assert found, f"no worker process under pid {root}"
    return sorted(found)


def describe_processes(*groups: list[int]) -> str:
    """Each group's pids with their names and parents (what an assertion on a process tree prints)."""
    return " | ".join(", ".join(f"{pid}:{_name(pid) or 'gone'}<{_parent(pid)}" for pid in group) for group in groups)


class Job:
    """``python -m hybrid.train`` in the background, its output read line by line."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "hybrid.train", *args], cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env=job_env(PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if re.search(pattern, line):
                return
        raise AssertionError(f"never saw {pattern!r}:\n{''.join(self.lines[-40:])}")

    def finish(self, timeout: float) -> tuple[int, str, float]:
        start = time.monotonic()
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
        finally:
            self.proc.kill()
        return self.proc.returncode, "".join(self.lines) + rest, time.monotonic() - start
