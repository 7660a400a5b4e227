"""One ordered stream of collectives per set of process groups.

gloo and NCCL pair the collectives of a group by the order they are issued
in: the k-th collective on a group on one rank meets the k-th on every other
rank. Two threads issuing collectives on the same groups at once (two DDP
models, each with a communication thread of its own, in one backward) issue
them in an order that differs from rank to rank, and gloo then aborts with
"Received data size doesn't match expected size" or waits forever.

So every collective a communicator issues off the caller's thread goes
through one :class:`OrderedStream` per :class:`~hybrid.core.comm.groups.CommGroups`,
shared by every DDP model and every communicator built on those groups: one
thread takes jobs from one FIFO queue, in the order they were handed over.
DDP hands buckets over in its bucket order, and autograd runs a backward in
an order fixed by the graph, so with the same models and the same backward
on every rank the queue holds the same jobs in the same order everywhere:
exactly the condition under which plain DDP's own all-reduces of two models
sharing one process group match up.

A job that fails (a peer gone, a timeout) fails every later job fast with the
same cause: the groups may be left half-way through a collective, and
talking over them again would only wait out another timeout. Build new
groups to go on.
"""

from __future__ import annotations

import queue
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

__all__ = ["OrderedStream", "drop_tracebacks"]

_LIVE: "weakref.WeakSet[OrderedStream]" = weakref.WeakSet()  # for OrderedStream.forget_failures


@dataclass
class _Job:
    run: Callable[[], Any]
    future: torch.futures.Future
    event: "torch.cuda.Event | None" = None  # CUDA: wait for the work that filled the tensor
    device: "torch.device | None" = None
    on_start: Callable[[], None] | None = None
    on_finish: Callable[[], None] | None = None


def drop_tracebacks(exc: BaseException | None) -> None:
    """Clear the traceback of ``exc`` and of every exception it chains (context or cause): the frames they keep
    alive, with their locals, go."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__context__ or exc.__cause__


class OrderedStream:
    """A thread serving one FIFO queue of collective jobs; started by the first user, stopped after the last.

    At most one thread serves a stream at any time: the thread itself gives
    up its place (under the lock) only when no user holds the stream and no
    job is queued, so a user who comes back while it drains finds it still
    running, and no job is ever queued behind a thread that has left.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._users = 0
        self._error: BaseException | None = None
        self._failures: list[BaseException] = []  # every exception a job's Future was completed with
        _LIVE.add(self)

    @staticmethod
    def forget_failures() -> int:
        """Drop the tracebacks of every exception any live stream's jobs failed with, and those of the exceptions
        they chain. A Future holds its exception from C++, where Python's collector cannot see it: the
        traceback's frames (the communicator's, its groups', the DDP hook's state) would stay alive after a
        failed session is let go, with every socket and thread of its groups (recovery in place builds new
        ones: hybrid.app.state.in_place). Returns how many exceptions were let go."""
        dropped = 0
        for stream in list(_LIVE):
            with stream._lock:
                failures, stream._failures = stream._failures, []
            for exc in failures:
                drop_tracebacks(exc)
                dropped += 1
        return dropped

    # Users: each DDP hook holds the stream while it is registered.

    def attach(self) -> None:
        """Count one more user; start the thread if none is serving."""
        with self._lock:
            self._users += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()

    def detach(self, timeout_s: float = 10.0) -> None:
        """Count one user less; after the last, the thread stops once the queued jobs are served (this
        waits for that at most ``timeout_s``; the thread goes on draining if it takes longer)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            thread = self._thread
            if self._users or thread is None:
                return
            self._queue.put(None)  # wake the thread so that it can see there is no user left
        if thread is not threading.current_thread():
            thread.join(timeout_s)

    @property
    def active(self) -> bool:
        """Whether a thread serves the stream now (jobs submitted now run on it)."""
        return self._thread is not None

    def on_own_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # Jobs.

    def submit(self, run: Callable[[], Any], future: torch.futures.Future | None = None, *,
               event: "torch.cuda.Event | None" = None, device: "torch.device | None" = None,
               on_start: Callable[[], None] | None = None,
               on_finish: Callable[[], None] | None = None) -> torch.futures.Future:
        """Queue ``run`` (it issues collectives and waits for them); the returned Future (``future`` if
        given) completes with its result, or with its exception. On CUDA, ``event`` marks the work that
        produced the input: the job waits for it on a side stream of ``device`` before it starts."""
        future = future if future is not None else torch.futures.Future()
        with self._lock:
            if self._thread is None:
                raise RuntimeError(f"{self.name}: no user holds this stream (attach() first)")
            self._queue.put(_Job(run, future, event, device, on_start, on_finish))
        return future

    def call(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` on the stream, after every job queued before it, and return its result (or raise its
        exception). On the stream's own thread it runs at once. The wait ends because every job ends:
        each collective a job waits for fails after the groups' timeout, and a job that fails in any way
        completes its Future with the exception."""
        if self.on_own_thread():
            return run()
        return self.submit(run).wait()

    def _serve(self) -> None:
        side_stream = None
        while True:
            job = self._queue.get()
            if job is None:
                with self._lock:
                    if self._users == 0 and self._queue.empty():
                        self._thread = None  # from here on, attach() starts a new thread
                        return
                continue  # someone came back, or queued a job, while this one was draining
            try:
                if job.event is None:
                    self._run(job)
                    continue
                if side_stream is None:
                    side_stream = torch.cuda.Stream(device=job.device)
                # The Future records the current stream when it completes: complete it on the side stream.
                with torch.cuda.device(job.device), torch.cuda.stream(side_stream):
                    side_stream.wait_event(job.event)
                    self._run(job)
            except BaseException as exc:  # anything around the job (CUDA set-up): its Future must still end
                self._fail(job, exc)

    def _run(self, job: _Job) -> None:
        if self._error is not None:
            job.future.set_exception(RuntimeError(f"an earlier collective on these groups failed: {self._error}"))
            return
        try:
            if job.on_start is not None:
                job.on_start()
            result = job.run()
            if job.on_finish is not None:
                job.on_finish()
        except BaseException as exc:  # surfaced through the Future (DDP re-raises it from backward)
            self._fail(job, exc)
            return
        job.future.set_result(result)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        """Fail ``job`` and every later one: the groups may be half-way through a collective."""
        self._error = self._error or exc
        with self._lock:
            self._failures.append(exc)
        if not job.future.done():
            job.future.set_exception(exc)
