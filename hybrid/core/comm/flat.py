"""Flat: one all-reduce over every rank, the baseline every other algorithm is judged against.

Averaging (fp32/fp64: sum, then divide once) costs a pass over the tensor
that a bare summing all-reduce does not make. On gloo the transport makes it:
``ReduceOp.AVG`` sums and then divides on gloo's own thread, with the same
bits as sum-then-divide, so there is no pass and no Python callback of ours
in the DDP hook (``experiments/hook_ab.py`` compares both with DDP).
Elsewhere (NCCL, whose AVG scales by 1/n and so rounds differently; a torch
without gloo AVG) flat sums and divides itself.

A tensor of at least ``SPLIT_MIN_BYTES`` is all-reduced as two pieces issued
together, a big head and a tail of 1/8: gloo's two worker threads then work on
both at once. Below that the second collective costs more than it saves, so
smaller tensors go in one piece (the measured crossover: experiments/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES, Communicator
from hybrid.core.comm.counters import PhaseCounters, allreduce_bytes
from hybrid.core.comm.groups import CommGroups
from hybrid.core.timeline import current_bucket, profiling

__all__ = ["FlatCommunicator", "SPLIT_MIN_BYTES", "TAIL_FRACTION"]

SPLIT_MIN_BYTES = 32 * 2**20  # below this the division is cheaper than a second collective
TAIL_FRACTION = 8  # the tail is 1/8 of the tensor


def _pieces(flat: torch.Tensor, divisor: int | None) -> list[torch.Tensor]:
    """What flat all-reduces: ``flat`` whole, or (averaging a large tensor) a head and a tail of
    1/TAIL_FRACTION (views)."""
    if divisor is None or flat.nbytes < SPLIT_MIN_BYTES:
        return [flat]
    tail_len = max(1, flat.numel() // TAIL_FRACTION)
    return [flat[:-tail_len], flat[-tail_len:]]


class FlatCommunicator(Communicator):
    name = "flat"
    group_kinds = ("world",)

    def __init__(self, groups: CommGroups, counters: PhaseCounters | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none") -> None:
        if inter_compression != "none":
            raise ValueError(
                f"comm.inter_compression={inter_compression!r} compresses the inter-node phase of hierarchical "
                "and sharded; flat has no separate inter-node phase: use none")
        super().__init__(groups, counters, chunk_bytes)
        # gloo's ReduceOp.AVG sums, then divides by the group size on gloo's own
        # thread: the very bits of sum-then-divide (tests/test_comm_multiprocess
        # checks them), without a pass or a Python callback of ours. NCCL's AVG
        # scales by 1/n instead (other bits for n not a power of two), so it is
        # used on gloo only; torch builds without gloo AVG fall back to SUM.
        self.transport_avg = self.groups.inter_backend == "gloo"

    def _all_reduce(self, piece: torch.Tensor, average: bool, async_op: bool = False) -> tuple[Any, bool]:
        """All-reduce ``piece``: AVG where ``average`` and the transport averages, else SUM.

        Returns the Work (None unless ``async_op``) and whether the transport averaged.
        """
        group = self.groups.world
        if average and self.transport_avg:
            try:
                return dist.all_reduce(piece, op=dist.ReduceOp.AVG, group=group, async_op=async_op), True
            except (ValueError, RuntimeError) as exc:  # raised before anything is sent, alike on every rank
                if "AVG" not in str(exc):
                    raise
                self.transport_avg = False
        return dist.all_reduce(piece, group=group, async_op=async_op), False

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable = None, gather: bool = True) -> None:
        world = self.topology.world_size
        pieces = _pieces(flat, divisor)
        if len(pieces) == 1:
            with self._phase("flat_allreduce", allreduce_bytes(flat.nbytes, world)):
                _, averaged = self._all_reduce(flat, average=divisor is not None)
            if divisor is not None and not averaged:
                self._divide_(flat, divisor)
            return
        with self._phase("flat_allreduce", 0):
            started = [self._all_reduce(piece, average=True, async_op=True) for piece in pieces]
        for piece, (work, averaged) in zip(pieces, started):
            self._wait("flat_allreduce", [work], allreduce_bytes(piece.nbytes, world))
            if not averaged:
                self._divide_(piece, divisor)

    def starter_for(self, tensor: torch.Tensor) -> Callable[..., "torch.futures.Future[torch.Tensor]"] | None:
        return self.start_mean_ if self.groups.gloo_only else None

    def start_mean_(self, tensor: torch.Tensor,
                    on_done: Callable[[], None] | None = None) -> "torch.futures.Future[torch.Tensor]":
        """Start averaging a contiguous ``tensor`` in place; the returned Future completes with it.

        Flat needs no thread of ours: the all-reduce runs on the transport's
        own threads (averaging there too, on gloo), and one callback chained to
        its Future records the time, divides where the transport did not, and
        calls ``on_done``, the way DDP's built-in hooks work; so the DDP hook
        issues it straight from backward. Same precision rules and pieces as
        :meth:`all_reduce_mean_`.
        """
        self._check_dtype(tensor)
        if not tensor.is_contiguous():
            raise ValueError("start_mean_ needs a contiguous tensor (DDP's buckets are)")
        world = self.topology.world_size
        if tensor.numel() == 0 or world == 1:
            if on_done is not None:
                on_done()
            ready: torch.futures.Future = torch.futures.Future()
            ready.set_result(tensor)
            return ready
        flat = tensor.view(-1)
        divisor = self._prescale_(flat)
        pieces = _pieces(flat, divisor)
        start = time.perf_counter()
        if len(pieces) == 1:
            return self._start_piece(flat, start, divisor, tensor, on_done)
        futures = [self._start_piece(piece, start, divisor, piece, None) for piece in pieces]

        def all_done(_: torch.futures.Future) -> torch.Tensor:
            for fut in futures:
                fut.wait()  # re-raises a piece's CommError
            if on_done is not None:
                on_done()
            return tensor

        return torch.futures.collect_all(futures).then(all_done)

    def _start_piece(self, piece: torch.Tensor, start: float, divisor: int | None, result: torch.Tensor,
                     on_done: Callable[[], None] | None) -> torch.futures.Future:
        nbytes = allreduce_bytes(piece.nbytes, self.topology.world_size)
        bucket = current_bucket.get()  # the callback runs on another thread: take the bucket's name along
        # Under a torch profiler: a hybrid::flat_allreduce range from issue to completion.
        profiled = record_function("hybrid::flat_allreduce") if profiling() else None
        with profiled or contextlib.nullcontext():
            work, averaged = self._all_reduce(piece, average=divisor is not None, async_op=True)
            future = work.get_future()
            if profiled is not None:
                future = profiled._call_end_callbacks_on_future(future)
        divide = divisor is not None and not averaged
        # The callback runs, and is let go of, on a gloo worker thread: it must not hold the communicator
        # (nor through it the groups). Were it the last holder at exit, the process group would be
        # destroyed on its own worker thread, which then joins itself ("Resource deadlock avoided").
        counters, describe_failure, divide_ = self.counters, self._failure_describer(), self._divide_

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                fut.wait()
            except Exception as exc:
                raise describe_failure("flat_allreduce", exc, start) from exc
            counters.add("flat_allreduce", time.perf_counter() - start, nbytes, start, bucket)
            if divide:
                divide_(piece, divisor)
            if on_done is not None:
                on_done()
            return result

        return future.then(done)
