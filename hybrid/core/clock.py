"""Every rank's clock put on rank 0's, so one timeline can hold spans from every machine.

Each rank's ``time.perf_counter`` has its own origin (a machine's monotonic
clock). Rank 0 and each other rank in turn exchange a few ping-pongs over the
default process group (Cristian's method, as NTP does): rank r notes its time
t1, sends; rank 0 answers with its time t0; rank r notes t2 on the answer.
Rank 0's clock read t0 somewhere between t1 and t2, so ``t0 - (t1 + t2) / 2``
is the offset to within half the round trip; the round with the shortest
round trip is kept. Ranks that share a machine share its monotonic clock, so
there the true offset is 0 and the measured one is the error itself
(tests/test_timeline.py checks it stays within the stated bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["ClockOffset", "align_to_rank0"]


@dataclass(frozen=True)
class ClockOffset:
    """Add ``offset_s`` to this rank's ``time.perf_counter()`` to read rank 0's; true to within ``error_s``."""

    offset_s: float
    error_s: float


def align_to_rank0(rounds: int = 8, group: dist.ProcessGroup | None = None) -> ClockOffset:
    """Measure this rank's clock offset to rank 0's (collective over ``group``, the default one if None).

    Rank 0 serves the other ranks one after another, ``rounds`` ping-pongs each;
    it returns offset 0, error 0.
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    buf = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        for peer in range(1, world):
            for _ in range(rounds):
                dist.recv(buf, src=_global(peer, group), group=group)
                buf[0] = time.perf_counter()
                dist.send(buf, dst=_global(peer, group), group=group)
        return ClockOffset(0.0, 0.0)
    best: ClockOffset | None = None
    for _ in range(rounds):
        t1 = time.perf_counter()
        dist.send(buf, dst=_global(0, group), group=group)
        dist.recv(buf, src=_global(0, group), group=group)
        t2 = time.perf_counter()
        estimate = ClockOffset(float(buf[0]) - (t1 + t2) / 2, (t2 - t1) / 2)
        if best is None or estimate.error_s < best.error_s:
            best = estimate
    assert best is not None
    return best


def _global(group_rank: int, group: dist.ProcessGroup | None) -> int:
    """send/recv take global ranks."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)
