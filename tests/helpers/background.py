"""Jobs that start when the session starts and run beside the tests that come first, for tests that read them later.

A program started the way its users start it (two ``torchrun`` agents: Lightning, the Hugging Face Trainer,
accelerate, the examples) pays its library's imports in every process, about 2 CPU-seconds each, and none
of it can be forked from a warm process; a test of a failure (a node killed, an elastic restart) mostly
waits. The suite runs the one-process tiers first (unit, then packaging: about a minute, mostly on one
core), so these jobs, started in :data:`LANES` background threads in the order they were declared, use
the other core then and wait while others compute: two at a time, since most of them mostly wait. A test
reads its job with :func:`result`, which waits for it (or runs it at once if it was not started:
``pytest tests/test_examples.py -k hf``). A test marked ``background`` is such a job itself
(tests/conftest.py runs its function in these threads).

Jobs must not depend on the tests around them: their own temporary folders, ports outside the ones tests
pick (torchrun's documented 29400 is below the kernel's ephemeral range; the jobs that use it, the examples,
run one at a time: ``alone``), a session of their own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["declare", "result", "start", "started", "stop", "track", "wait_all"]

LANES = 2  # jobs at once: most wait far more than they compute (a heartbeat, a timeout, a slow link, start-up)
_DECLARED: dict[str, tuple[Callable[[str], bool], Callable[[], Any], str | None]] = {}  # name -> (wanted?, job, alone)
_STARTED: dict[str, Future] = {}
_PROCESSES: list[subprocess.Popen] = []
_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
_QUEUE: list[str] = []  # started, not yet running: taken in order, skipping a job whose ``alone`` group is running
_RUNNING: set[str] = set()  # the ``alone`` groups of the jobs running now
_CHANGED = threading.Condition(_LOCK)


def declare(name: str, wanted_by: Callable[[str], bool], job: Callable[[], Any], alone: str | None = None) -> None:
    """Make ``job`` startable in the background under ``name``, for the tests whose ids ``wanted_by`` accepts.
    Jobs of the same ``alone`` group never run at the same time (the examples: their documented fixed port)."""
    _DECLARED[name] = (wanted_by, job, alone)


def start(test_ids: list[str]) -> list[str]:
    """Start, in :data:`LANES` threads, in the order declared, the jobs the tests ``test_ids`` want; their names."""
    global _EXECUTOR
    names = [name for name, (wanted_by, _, _) in _DECLARED.items()
             if name not in _STARTED and any(wanted_by(test_id) for test_id in test_ids)]
    if names and _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="background-job")
    with _LOCK:
        _QUEUE.extend(names)
    for name in names:
        _STARTED[name] = Future()  # the job's own outcome, set by whichever runner takes it
        _EXECUTOR.submit(_run_next)
    return names


def _run_next() -> Any:
    """Take the first queued job that may run now (its ``alone`` group idle), run it, and set its outcome."""
    with _CHANGED:
        while True:
            name = next((n for n in _QUEUE if _DECLARED[n][2] is None or _DECLARED[n][2] not in _RUNNING), None)
            if name is not None:
                break
            _CHANGED.wait(timeout=1.0)
        _QUEUE.remove(name)
        alone = _DECLARED[name][2]
        if alone is not None:
            _RUNNING.add(alone)
    try:
        outcome = _STARTED[name]
        try:
            outcome.set_result(_DECLARED[name][1]())
        except BaseException as exc:  # noqa: BLE001 - handed to the job's test, which raises it
            outcome.set_exception(exc)
    finally:
        with _CHANGED:
            if alone is not None:
                _RUNNING.discard(alone)
            _CHANGED.notify_all()


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
    if _EXECUTOR is not None:
        _EXECUTOR.shutdown(wait=False, cancel_futures=True)
    with _LOCK:
        for process in _PROCESSES:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
