"""The fork server that a local launch's processes are forked from: each node's agent, and an elastic job's
rendezvous store.

A fresh interpreter per launching process (multiprocessing's ``forkserver``) imports torch, torch's elastic
agent and the job's entry point module once, and runs no torch op, so forking it is safe. As processes of
their own, every agent and store would pay about 2.5 s of CPU for those imports, every launch. A process
forked here can still be placed elsewhere: a testbed node is entered in the child
(:mod:`hybrid.runtime.netns`).
"""

from __future__ import annotations

import subprocess
import sys
import types
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

__all__ = ["PRELOAD", "ForkedProcess", "fork", "name_process", "start_fork_server"]

# What the server imports once, so that no forked process pays it: torch, its elastic agent, our agent, and
# what the agent imports before forking its workers (hybrid.runtime.agent.BEFORE_FORK).
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.launcher.api",
           "torch.distributed.elastic.multiprocessing.errors", "hybrid.runtime.agent", "hybrid.runtime.netns"]


class ForkedProcess:
    """A process forked from the fork server, seen through ``subprocess.Popen``'s ``pid``, ``poll``, ``wait``
    and ``returncode``."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0)
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


@contextmanager
def _without_main() -> Iterator[None]:
    """Hide the caller's ``__main__`` while multiprocessing starts a process: it would run the caller's main
    script again there (a script that launches at its top level would launch again), and neither the fork
    server nor a forked process needs anything of it (an agent's entry point comes from the job file)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_fork_server(entrypoint: Callable[..., Any] | None = None) -> Any:
    """Start the fork server, with :data:`PRELOAD` and ``entrypoint``'s module imported; return its
    multiprocessing context. Calling it early lets that import run while the caller does other work (the
    trainer's checks); the first call's entry point is the one preloaded, and later calls reuse the server."""
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*PRELOAD, getattr(entrypoint, "__module__", "hybrid.runtime.agent")])
    with _without_main():
        forkserver.ensure_running()
    return context


def fork(target: Callable[..., Any], args: Sequence[Any], name: str,
         entrypoint: Callable[..., Any] | None = None) -> ForkedProcess:
    """``target(*args)`` in a process forked from the fork server (started, with ``entrypoint``'s module
    preloaded, if this process has none yet)."""
    process = start_fork_server(entrypoint).Process(target=target, args=tuple(args), name=name)
    with _without_main():
        process.start()
    return ForkedProcess(process)


def name_process(name: str) -> None:
    """Name this process (``ps -o comm``, /proc/PID/comm; at most 15 characters): processes forked from
    another share its command line, so the name is what tells them apart."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the command line will have to do
