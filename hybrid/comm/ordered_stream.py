"""One ordered stream of collectives per set of process groups.

gloo and NCCL pair the collectives of a group by the order they are issued
in: the k-th collective on a group on one rank meets the k-th on every other
rank. Two threads issuing collectives on the same groups at once (two DDP
models, each with a communication thread of its own, in one backward) issue
them in an order that differs from rank to rank, and gloo then aborts with
"Received data size doesn't match expected size" or waits forever.

So every collective a communicator issues off the caller's thread goes
through one :class:`OrderedStream` per :class:`~hybrid.comm.groups.CommGroups`,
shared by every DDP model and every communicator built on those groups: one
thread takes jobs from one FIFO queue, in the order they were handed over.
DDP hands buckets over in its bucket order, and autograd runs a backward in
an order fixed by the graph, so with the same models and the same backward
on every rank the queue holds the same jobs in the same order everywhere:
exactly the condition under which plain DDP's own all-reduces of two models
sharing one process group match up.

A job that fails (a peer gone, a timeout) fails every later job fast with the
same cause: the groups are broken, and talking over them again would only
wait out another timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = ["OrderedStream"]


@dataclass
class _Job:
    run: Callable[[], Any]
    future: torch.futures.Future
    event: "torch.cuda.Event | None" = None  # CUDA: wait for the work that filled the tensor
    device: "torch.device | None" = None
    on_start: Callable[[], None] | None = None
    on_finish: Callable[[], None] | None = None
    queued: float = field(default_factory=time.perf_counter)


class OrderedStream:
    """A thread serving one FIFO queue of collective jobs; started by the first user, stopped after the last.

    ``timeout_s`` is the groups' per-collective timeout: it bounds how long
    :meth:`call` waits (see there).
    """

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._users = 0
        self._pending = 0
        self._error: BaseException | None = None

    # Users: each DDP hook holds the stream while it is registered.

    def attach(self) -> None:
        """Count one more user; start the thread if none is running."""
        with self._lock:
            self._users += 1
            if self._thread is None or not self._thread.is_alive():
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._queue,), name=self.name,
                                                daemon=True)
                self._thread.start()

    def detach(self, timeout_s: float = 10.0) -> None:
        """Count one user less; after the last, stop the thread once the queued jobs are served
        (waiting at most ``timeout_s``)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self._thread is None:
                return
            thread, self._thread = self._thread, None
            self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout_s)

    @property
    def active(self) -> bool:
        """Whether jobs submitted now are served by the thread (some user holds it)."""
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
            self._pending += 1
            self._queue.put(_Job(run, future, event, device, on_start, on_finish))
        return future

    def call(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` on the stream, after every job queued before it, and return its result.

        The wait is bounded: each job ahead waits at most three phases of the
        groups' timeout per collective before gloo gives up on it, so this
        waits ``3 x timeout_s`` per job ahead (and for this one), plus slack.
        """
        done = threading.Event()
        with self._lock:
            ahead = self._pending
        future = self.submit(run)
        future.add_done_callback(lambda _: done.set())
        bound = 3 * self.timeout_s * (ahead + 1) + 10.0
        if not done.wait(bound):
            raise TimeoutError(f"{self.name}: a job waited {bound:.0f}s behind {ahead} others without finishing")
        return future.wait()

    def _serve(self, jobs: "queue.SimpleQueue[_Job | None]") -> None:
        side_stream = None
        while True:
            job = jobs.get()
            if job is None:
                return
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
            finally:
                with self._lock:
                    self._pending -= 1

    def _run(self, job: _Job) -> None:
        if self._error is not None:
            job.future.set_exception(RuntimeError(f"an earlier collective on these groups failed: {self._error}"))
            return
        if job.on_start is not None:
            job.on_start()
        try:
            result = job.run()
        except BaseException as exc:  # surfaced through the Future (DDP re-raises it from backward)
            self._error = exc
            if job.on_finish is not None:
                job.on_finish()
            job.future.set_exception(exc)
            return
        if job.on_finish is not None:
            job.on_finish()
        job.future.set_result(result)
