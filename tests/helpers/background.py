"""Jobs that start when the session starts and run beside the tests that come first, for tests that read them later.

A program started the way its users start it (two ``torchrun`` agents: Lightning, the Hugging Face Trainer,
accelerate, the examples) pays its library's imports in every process, about 2 CPU-seconds each, and none
of it can be forked from a warm process; a test of a failure (a node killed, an elastic restart) mostly
waits. The suite runs the one-process tiers first (unit, then packaging: about a minute, mostly on one
core), so these jobs, started in one background thread in the order they were declared, use the other
core then and wait while others compute. A test reads its job with :func:`result`, which waits for it (or
runs it at once if it was not started: ``pytest tests/test_examples.py -k hf``). A test marked
``background`` is such a job itself (tests/conftest.py runs its function in this thread).

A job declared ``beside=True`` queues in a second lane instead, a thread of its own that also starts at the session's
start. That is for a job that only runs processes of its own and spends most of its time waiting on them (torchft's
groups on a slow testbed link, 70 s at a third of a core), which would otherwise hold a lane that long while the
machine has CPU to spare. Not for a job that races its own processes' start against a number of steps (a node killed
and started again must join before the end): at the session's start every core is taken, and such a node joined
after the last of 60 steps where, later in the first lane, it joins by step 33 with two CPU burners beside.

Jobs must not depend on the tests around them: their own temporary folders, ports outside the ones tests
pick (torchrun's documented 29400 is below the kernel's ephemeral range), a session of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["declare", "lanes_ended", "result", "start", "started", "stop", "track", "wait_all"]

_DECLARED: dict[str, tuple[Callable[[str], bool], Callable[[], Any], bool]] = {}  # name -> (wanted?, job, beside?)
_STARTED: dict[str, Future] = {}
_PROCESSES: list[subprocess.Popen] = []
_LOCK = threading.Lock()
# "first", and "second" for jobs that mostly wait on processes of their own: one thread each, made when first used.
_LANES: dict[str, ThreadPoolExecutor] = {}


def declare(name: str, wanted_by: Callable[[str], bool], job: Callable[[], Any], beside: bool = False) -> None:
    """Make ``job`` startable in the background under ``name``, for the tests whose ids ``wanted_by`` accepts;
    ``beside``: in the second lane (a job of its own processes that mostly waits)."""
    _DECLARED[name] = (wanted_by, job, beside)


def start(test_ids: list[str]) -> list[str]:
    """Start the jobs the tests ``test_ids`` want, one after the other in each lane; their names."""
    names = [name for name, (wanted_by, _, _) in _DECLARED.items()
             if name not in _STARTED and any(wanted_by(test_id) for test_id in test_ids)]
    for name in names:
        _, job, beside = _DECLARED[name]
        lane = "second" if beside else "first"
        if lane not in _LANES:
            _LANES[lane] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"background-{lane}-lane")
        _STARTED[name] = _LANES[lane].submit(_timed, lane, job)
    return names


_ENDED: dict[str, float] = {}  # lane -> when its last job so far ended (time.monotonic)


def _timed(lane: str, job: Callable[[], Any]) -> Any:
    try:
        return job()
    finally:
        _ENDED[lane] = time.monotonic()


def lanes_ended() -> dict[str, float]:
    """When each lane's last job ended (time.monotonic): the lanes' balance against the main one, for the log."""
    return dict(_ENDED)


def result(name: str, timeout_s: float = 600) -> Any:
    """The job's return value (its exception, raised here), waiting at most ``timeout_s`` for it."""
    if name not in _STARTED:
        return _DECLARED[name][1]()
    return _STARTED[name].result(timeout=timeout_s)


def started(name: str) -> bool:
    return name in _STARTED


def wait_all(timeout_s: float = 600) -> None:
    """Wait until every started job has ended (however): for a test that looks at every process on the machine."""
    for future in list(_STARTED.values()):
        try:
            future.exception(timeout=timeout_s)
        except Exception:  # cancelled or still running at the deadline: its own test reports it
            pass


def track(process: subprocess.Popen) -> subprocess.Popen:
    """Remember a job's process (started with ``start_new_session=True``) so that :func:`stop` can end it."""
    with _LOCK:
        _PROCESSES.append(process)
    return process


def stop() -> None:
    """End of the session: drop what has not started, kill the process groups of what is still running."""
    for executor in _LANES.values():
        executor.shutdown(wait=False, cancel_futures=True)
    with _LOCK:
        for process in _PROCESSES:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
