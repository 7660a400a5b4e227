"""Plug a communicator into torch DDP as a comm hook, keeping DDP's overlap.

DDP calls a comm hook once per gradient bucket, as soon as that bucket is
ready and strictly in bucket order on every rank, while backward goes on
computing the remaining gradients. It expects a ``Future`` back and waits for
all of them only at the end of backward. So bucketing, ``no_sync``,
``find_unused_parameters`` and overlap all keep working as long as the hook
returns quickly.

Our algorithms need three dependent phases per bucket. Chaining them with
``Future.then`` and waiting on another gloo collective inside the callback
deadlocks (gloo runs callbacks on its own worker threads), and running them
synchronously inside the hook loses the overlap. Instead the hook hands the
bucket to its groups' :class:`~hybrid.core.comm.ordered_stream.OrderedStream` and
returns a fresh Future; the stream's thread runs the phases with ordinary
blocking waits and completes the Future, while backward goes on computing
later buckets. There is one stream per ``CommGroups``, not one per DDP model:
several models in one backward (a GAN's generator and discriminator, teacher
and student) queue their buckets into the same FIFO in the order DDP hands
them over, so every rank issues the same collectives in the same order. A
thread per model would race the others on the same groups, in an order that
differs per rank (gloo then aborts with "Received data size doesn't match
expected size", or hangs).

A failing collective (peer gone, timeout) completes that bucket's Future with
the exception, which DDP re-raises from ``backward()``; every later bucket on
those groups fails fast with the same cause rather than talking to a broken
group.

A communicator whose average needs no dependent phases (flat) offers
``start_mean_``: the hook then issues its all-reduce(s) at once, from
backward, and returns the transport's own Future with one callback chained to
it (timing, the division where the transport did not average, this bucket's
trace), like DDP's built-in hooks; every bucket takes that path, so the order
of collectives stays DDP's bucket order on every rank, as with DDP's own
all-reduce (the thread hand-off would cost flat its speed next to plain DDP:
experiments/hook_ab.py).
"""

# No `from __future__ import annotations` here: DDP checks the hook's
# annotations against the real objects (dist.GradBucket, Future[Tensor]).
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hybrid.core.comm.base import SUPPORTED_DTYPES, Communicator
from hybrid.core.timeline import bucket_scope

__all__ = ["BucketObserver", "BucketTrace", "CommHookState", "register_comm_hook", "settle_buckets"]


@dataclass
class BucketTrace:
    """When one bucket was handed over, started and finished (``time.perf_counter``)."""

    index: int
    nbytes: int
    last: bool
    submitted: float
    started: float = 0.0
    finished: float = 0.0


class BucketObserver(Protocol):
    """Sees each gradient bucket DDP hands over (a node-sharded optimizer learns their layout from them)."""

    def bucket_ready(self, bucket: dist.GradBucket) -> None: ...


class CommHookState:
    """One DDP model's side of the hook: its traces and bucket count; the communication goes through the
    communicator's groups' shared ordered stream, which this state holds until :meth:`close`."""

    def __init__(self, communicator: Communicator, trace_len: int = 4096,
                 observer: BucketObserver | None = None) -> None:
        self.communicator = communicator
        # A node-sharded optimizer (hybrid.core.node_sharded_optimizer) learns DDP's buckets here, and needs
        # only its own shard of each averaged: the node then gathers updated parameters, not gradients.
        self.observer = observer
        self.traces: deque[BucketTrace] = deque(maxlen=trace_len)
        self.buckets_per_step: int = 0  # buckets in the last completed backward
        self._buckets_this_step = 0
        self._closed = False
        self._passthrough = False  # settle_buckets: hand buckets back untouched, no collectives
        # Which of the models hooked to this communicator this is: with inter_compression, each model's
        # buckets keep residuals of their own (bucket 0 of two models must not share one). The first keeps
        # the plain (bucket, size) keys that checkpoints hold.
        self.model_index = communicator.hooks_registered
        communicator.hooks_registered += 1
        self._stream = communicator.groups.ordered_stream()
        self._stream.attach()

    def submit_bucket(self, bucket: dist.GradBucket) -> "torch.futures.Future[torch.Tensor]":
        """DDP's bucket: shown to the observer (outside :func:`settle_buckets`), then :meth:`submit`."""
        if self.observer is not None and not self._passthrough:
            self.observer.bucket_ready(bucket)
        return self.submit(bucket.buffer(), index=bucket.index(), is_last=bucket.is_last())

    def submit(
        self, tensor: torch.Tensor, index: int = 0, is_last: bool = False
    ) -> "torch.futures.Future[torch.Tensor]":
        """Queue ``tensor`` for averaging; the returned Future completes with it."""
        if self._closed:
            raise RuntimeError("CommHookState is closed: register a new hook to keep training")
        if self._passthrough:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(tensor)
            return done
        trace = BucketTrace(index, tensor.nbytes, is_last, submitted=time.perf_counter())
        self.traces.append(trace)
        self._buckets_this_step += 1
        if is_last:
            self.buckets_per_step, self._buckets_this_step = self._buckets_this_step, 0
        direct = self.communicator.starter_for(tensor)
        if direct is not None:
            # Flat: no hand-off to a thread; every bucket of that size goes this way, in DDP's order.
            # (auto may send other sizes through the stream: those talk over other groups.)
            trace.started = trace.submitted

            def finished() -> None:
                trace.finished = time.perf_counter()

            with bucket_scope(index, tensor.nbytes):
                return direct(tensor, on_done=finished)
        event = None
        if tensor.is_cuda:
            # The bucket was filled on the backward stream: the comm thread
            # must not read it before that work is done.
            event = torch.cuda.Event()
            event.record()
            future: torch.futures.Future = torch.futures.Future(devices=[tensor.device])
        else:
            future = torch.futures.Future()
        key = (index, tensor.numel()) if self.model_index == 0 else (f"model{self.model_index}", index, tensor.numel())

        def started() -> None:
            trace.started = time.perf_counter()

        def finished_reducing() -> None:
            trace.finished = time.perf_counter()

        def average() -> torch.Tensor:
            with bucket_scope(index, tensor.nbytes):  # on the stream's thread: its phases are this bucket's
                # Looked up per bucket, not bound once: a wrapper put on the communicator later still applies.
                comm = self.communicator
                average = comm.reduce_scatter_mean_ if self.observer is not None else comm.all_reduce_mean_
                return average(tensor, key=key)

        return self._stream.submit(average, future,
                                   event=event, device=tensor.device, on_start=started,
                                   on_finish=finished_reducing)

    @contextlib.contextmanager
    def passthrough(self) -> Iterator[None]:
        """Inside: buckets are handed back untouched and nothing is communicated (see :func:`settle_buckets`)."""
        self._passthrough = True
        try:
            yield
        finally:
            self._passthrough = False

    def close(self, timeout_s: float = 10.0) -> None:
        """Let go of the stream; the last user stops its thread after the queued buckets are served
        (waiting at most ``timeout_s``)."""
        if self._closed:
            return
        self._closed = True
        self._stream.detach(timeout_s)


def _hybrid_comm_hook(
    state: CommHookState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    return state.submit_bucket(bucket)


def register_comm_hook(model: DistributedDataParallel, communicator: Communicator,
                       observer: BucketObserver | None = None) -> CommHookState:
    """Make ``model`` average its gradient buckets with ``communicator``.

    Any number of DDP models may share one communicator (or communicators
    built on one ``CommGroups``): their buckets are averaged in the order DDP
    hands them over, one stream for all. Program shapes the hook cannot serve
    are refused here with a ``ValueError``, rather than failing in backward.
    Returns the hook's state; call its ``close()`` when training ends.
    ``observer``: sees every bucket of a real backward, and each bucket is then
    averaged only where this rank owns it (:meth:`Communicator.reduce_scatter_mean_`).
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"register_comm_hook needs a DistributedDataParallel model, got {type(model).__name__}")
    _check_supported(model, communicator)
    state = CommHookState(communicator, observer=observer)
    try:
        model.register_comm_hook(state, _hybrid_comm_hook)
    except BaseException:  # e.g. a hook already registered: let go of the stream and the model number
        state.close()
        communicator.hooks_registered -= 1
        raise
    return state


def _check_supported(model: DistributedDataParallel, communicator: Communicator) -> None:
    """Refuse, in one line, what would average over the wrong ranks or fail inside backward."""
    topo = communicator.topology
    ranks = dist.get_process_group_ranks(model.process_group)
    expected = sorted(r for node in topo.nodes for r in node)  # every rank of the job (a node's: NodeCommunicator)
    if sorted(ranks) != expected:
        raise ValueError(
            f"the DDP model's process group holds ranks {ranks}, but the communicator averages over the "
            f"{topo.world_size} ranks {expected} of its topology: wrap the model in DDP over a group of those")
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype not in SUPPORTED_DTYPES})
    if dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise ValueError(f"the model has trainable parameters of dtype {', '.join(dtypes)}; the hook averages "
                         f"{allowed}")
    devices = sorted({p.device.type for p in model.parameters() if p.requires_grad})
    backends = {communicator.groups.intra_backend, communicator.groups.inter_backend}
    if "nccl" in backends and devices != ["cuda"]:
        raise ValueError(f"the model's parameters are on {', '.join(devices)}, but the communicator's groups use "
                         "nccl, which needs CUDA tensors: move the model to its GPU or build the groups with gloo")


def settle_buckets(ddp: DistributedDataParallel, state: CommHookState | None, backward: Callable[[], None]) -> None:
    """Let DDP rebuild its buckets before the first real step, so every step sees the same buckets.

    DDP reduces its first synchronised backward in one bucket (or its initial
    assignment), then rebuilds the buckets in the order gradients became ready.
    A run resumed from a checkpoint would start over with that first set while
    the uninterrupted run has the rebuilt one; where a bucket's elements are
    summed in an order that depends on the bucket (a ring over more than two
    ranks) or per-bucket state is kept (error-feedback residuals), it could
    not continue the uninterrupted run exactly. ``backward`` runs one forward
    and backward (any batch of the training data); with our hook (``state``)
    every bucket is handed back without communicating, with DDP's own
    all-reduce (``state=None``) it is averaged and thrown away. Afterwards the
    gradients are as before any backward (zeros where they are views into
    DDP's buckets), and the module's buffers and the random number
    generators are as they were. The rebuild itself happens in the next
    forward (DDP broadcasts the new assignment from rank 0 there).
    Collective; every rank must call it.
    """
    module = ddp.module
    buffers = [b.detach().clone() for b in module.buffers()]
    devices = sorted({p.device.index for p in module.parameters() if p.device.type == "cuda"})
    with state.passthrough() if state is not None else contextlib.nullcontext(), \
            torch.random.fork_rng(devices=devices):
        backward()
    with torch.no_grad():
        for b, saved in zip(module.buffers(), buffers):
            b.copy_(saved)
        for p in module.parameters():
            if p.grad is None:
                continue
            if ddp.gradient_as_bucket_view:
                # A view into DDP's bucket: keep it one. (It also matters to plain DDP, which divides a
                # view in place but writes grad * (1 / world) into a gradient that is not one yet: other
                # last bits where the world size is not a power of two, on the first step only.)
                p.grad.zero_()
            else:
                p.grad = None  # as before any backward
