"""Flat: one all-reduce over every rank, the baseline every other algorithm is judged against.

Averaging (fp32/fp64: sum, then divide once) costs a pass over the tensor
that a bare all-reduce does not make; measured on 2x2 loopback it adds ~8%
to a 100 MB all-reduce (276 -> 299 ms). So a large tensor is all-reduced as
two pieces issued together, a big head and a tail of 1/8: while gloo's
threads still reduce the tail, this thread divides the head, and only the
tail's division adds to the time (measured: 263 ms, below the bare 276,
since gloo's two threads also work on the pieces in parallel). Below
``SPLIT_MIN_BYTES`` the second collective costs more than it hides (10 MB:
36.7 ms split vs 34.0 ms unsplit), so smaller tensors go in one piece.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hybrid.comm.base import LOW_PRECISION, Communicator
from hybrid.comm.counters import allreduce_bytes

__all__ = ["FlatCommunicator", "SPLIT_MIN_BYTES", "TAIL_FRACTION"]

SPLIT_MIN_BYTES = 32 * 2**20  # below this the division is cheaper than a second collective
TAIL_FRACTION = 8  # the tail is 1/8 of the tensor


def _head_and_tail(flat: torch.Tensor) -> list[torch.Tensor]:
    """The two pieces of a large tensor: a head, and a tail of 1/TAIL_FRACTION (views)."""
    tail_len = max(1, flat.numel() // TAIL_FRACTION)
    return [flat[:-tail_len], flat[-tail_len:]]


class FlatCommunicator(Communicator):
    name = "flat"

    def _sum_(self, flat: torch.Tensor, divisor: int | None) -> None:
        world = self.topology.world_size
        group = self.groups.world
        if divisor is None or flat.nbytes < SPLIT_MIN_BYTES:
            with self._phase("flat_allreduce", allreduce_bytes(flat.nbytes, world)):
                dist.all_reduce(flat, group=group)
            if divisor is not None:
                flat.div_(divisor)
            return
        pieces = _head_and_tail(flat)
        with self._phase("flat_allreduce", 0):
            works = [dist.all_reduce(piece, group=group, async_op=True) for piece in pieces]
        for piece, work in zip(pieces, works):
            self._wait("flat_allreduce", [work], allreduce_bytes(piece.nbytes, world))
            piece.div_(divisor)

    def start_mean_(self, tensor: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
        """Start averaging a contiguous ``tensor`` in place; the returned Future completes with it.

        Flat needs no thread of ours: the all-reduce runs on the transport's
        own threads and the division is chained to its Future, the way DDP's
        built-in hooks work, so the DDP hook issues it straight from
        backward. Same precision rules and pieces as :meth:`all_reduce_mean_`.
        """
        self._check_dtype(tensor)
        if not tensor.is_contiguous():
            raise ValueError("start_mean_ needs a contiguous tensor (DDP's buckets are)")
        world = self.topology.world_size
        if tensor.numel() == 0 or world == 1:
            ready: torch.futures.Future = torch.futures.Future()
            ready.set_result(tensor)
            return ready
        flat = tensor.view(-1)
        low_precision = tensor.dtype in LOW_PRECISION
        if low_precision:
            flat.div_(world)
            pieces = [flat]
        elif flat.nbytes >= SPLIT_MIN_BYTES:
            pieces = _head_and_tail(flat)
        else:
            pieces = [flat]
        start = time.perf_counter()
        futures = [self._start_piece(piece, start, None if low_precision else world) for piece in pieces]
        if len(futures) == 1:
            return futures[0].then(lambda _: tensor)
        return torch.futures.collect_all(futures).then(lambda _: tensor)

    def _start_piece(self, piece: torch.Tensor, start: float, divisor: int | None) -> torch.futures.Future:
        nbytes = allreduce_bytes(piece.nbytes, self.topology.world_size)
        work = dist.all_reduce(piece, group=self.groups.world, async_op=True)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            try:
                fut.wait()
            except Exception as exc:
                raise self._comm_error("flat_allreduce", exc, start) from exc
            self.counters.add("flat_allreduce", time.perf_counter() - start, nbytes)
            return piece if divisor is None else piece.div_(divisor)

        return work.get_future().then(done)
