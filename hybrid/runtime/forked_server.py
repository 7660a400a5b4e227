"""multiprocessing's fork server, started by forking the launching process instead of a fresh interpreter.

A local launch forks its agents from multiprocessing's fork server (:func:`hybrid.runtime.launch.start_agent_server`).
That server is normally a new interpreter, which imports torch and the agent's modules again: about 2.8 s of CPU
per launch, paid by every ``python -m hybrid.train`` that has just imported the same modules itself. A process
that has imported torch but has run no torch op and started no thread (the trainer's command line before its
checks) is as safe to fork as the fresh server, so the server can be that process's fork instead, with only the
rest of its preload left to import.

The server is multiprocessing's own (``multiprocessing.forkserver.main``, the command it would have run); only
how its process starts changes. The child is made to look as the fresh interpreter would: no logging handlers
(the parent's Hydra handlers on the root logger would write into its run's log), none of the parent's ends of
the pipes passed to it (the server ends when its last client closes the "alive" pipe, so the parent's end must
not live on in it), and a fresh lock for the server's bookkeeping (copied while held).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch  # noqa: F401  (before the thread count below)

from hybrid.runtime.distributed import open_descriptors

__all__ = ["forking_this_process"]

# Once per process: a server started again (the first one died) would be forked from a process that may have
# run torch ops since; it starts from a fresh interpreter instead.
_forked = False


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


# torch's import starts a native thread of its own (a fresh server has it too, and forks its agents with it);
# any thread beyond these, an OpenMP pool started by a torch op among them, makes forking this process unsafe.
_THREADS_AFTER_TORCH = _native_threads()


@contextmanager
def forking_this_process() -> Iterator[None]:
    """While multiprocessing starts its fork server inside this block, the server is a fork of this process.

    The caller promises what makes that safe: torch imported but no torch op run. A thread beyond torch's own
    (an intra-op pool that an op started, or any other) is seen, and so is a second server for this process:
    the server then starts as usual, from a fresh interpreter."""
    from multiprocessing import util

    spawn = util.spawnv_passfds

    def fork_instead(path: str, args: Sequence[str], passfds: Sequence[int]) -> int:
        global _forked
        code = args[list(args).index("-c") + 1] if "-c" in args else ""
        if (_forked or "multiprocessing.forkserver" not in code or not os.path.isdir("/proc/self/fd")
                or not 0 < _native_threads() <= _THREADS_AFTER_TORCH):
            return spawn(path, args, passfds)
        _forked = True
        for stream in (sys.stdout, sys.stderr):  # else the child's copy of what is buffered is written again
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the server: never returns into the caller's code
            status = 1
            try:
                util.spawnv_passfds = spawn
                _as_a_fresh_interpreter(passfds)
                exec(code, {"__name__": "__main__"})  # multiprocessing.forkserver.main(...)
                status = 0
            except SystemExit as exc:  # the server's end: every client has closed the alive pipe
                status = exc.code if isinstance(exc.code, int) else 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(status)
        return pid

    util.spawnv_passfds = fork_instead
    try:
        yield
    finally:
        util.spawnv_passfds = spawn


def _as_a_fresh_interpreter(passfds: Sequence[int]) -> None:
    """What the fork inherited that a fresh interpreter would not have, and that would change what it does."""
    from multiprocessing import forkserver

    root = logging.getLogger()  # where Hydra puts its handlers (the console, the run's log file)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.WARNING)
    _close_other_ends(passfds)
    forkserver._forkserver._lock = threading.Lock()  # the parent held it while it forked


def _close_other_ends(passfds: Sequence[int]) -> None:
    """Close this process's other descriptors of every pipe in ``passfds`` (the parent's write end of the alive
    pipe: the server would otherwise keep itself alive)."""
    pipes = open_descriptors("pipe:")
    passed = {pipes[fd] for fd in passfds if fd in pipes}
    for fd, pipe in pipes.items():
        if fd not in passfds and fd > 2 and pipe in passed:
            os.close(fd)
