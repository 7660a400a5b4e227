"""Per-phase time and traffic counters, readable after each step.

Phases have fixed names so every algorithm reports the same keys (a trainer can
log them side by side and a sweep can compare them):

- ``flat_allreduce``: the flat algorithm's single all-reduce over all ranks;
- ``intra_reduce``: inside the node, reduce to the leader (hierarchical) or the
  per-shard reduce that makes a reduce-scatter (sharded);
- ``inter_allreduce``: across nodes, among leaders (hierarchical) or among
  same-local-rank workers, one shard each (sharded);
- ``intra_broadcast``: inside the node, broadcast from the leader
  (hierarchical) or the per-shard broadcast that makes an all-gather (sharded).

Bytes are what this rank sends in a bandwidth-optimal (ring/pipelined)
schedule of each collective, the convention behind nccl-tests' bus bandwidth:
an all-reduce of S bytes over p ranks sends 2(p-1)/p * S per rank; a reduce,
broadcast, reduce-scatter or all-gather of S bytes sends (p-1)/p * S. They are
derived from the sizes, not sniffed from sockets, so they are the same on any
transport.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from hybrid.core.costmodel import PHASES
from hybrid.core.timeline import StepRecorder, current_bucket

__all__ = ["PHASES", "PhaseCounters", "PhaseStats", "allreduce_bytes", "rooted_bytes"]



def allreduce_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``group_size`` ranks."""
    if group_size <= 1:
        return 0
    return 2 * (group_size - 1) * nbytes // group_size


def rooted_bytes(nbytes: int, group_size: int) -> int:
    """Bytes one rank sends (on average) in a pipelined reduce or broadcast, or a
    reduce-scatter / all-gather of ``nbytes`` in total."""
    if group_size <= 1:
        return 0
    return (group_size - 1) * nbytes // group_size


@dataclass
class PhaseStats:
    seconds: float = 0.0
    bytes: int = 0
    calls: int = 0


class PhaseCounters:
    """Accumulates seconds, bytes and calls per phase; safe to read from another thread.

    With a ``recorder`` (:class:`~hybrid.core.timeline.StepRecorder`), every phase that says when it started is
    also handed to it, with its bucket: the per-rank accounting and the timeline see the very intervals these
    counters sum.
    """

    def __init__(self, recorder: StepRecorder | None = None) -> None:
        self._lock = threading.Lock()
        self._stats = {name: PhaseStats() for name in PHASES}
        self.recorder = recorder

    def add(self, phase: str, seconds: float, nbytes: int, start: float | None = None,
            bucket: dict[str, int] | None = None) -> None:
        """Count ``seconds`` and ``nbytes`` for ``phase``; ``start`` (``time.perf_counter``) places it in time,
        ``bucket`` names its DDP bucket where the caller's thread is not the one that set
        :func:`~hybrid.core.timeline.bucket_scope`."""
        if phase not in self._stats:
            raise KeyError(f"unknown phase {phase!r}: one of {', '.join(PHASES)}")
        with self._lock:
            stats = self._stats[phase]
            stats.seconds += seconds
            stats.bytes += nbytes
            stats.calls += 1
        if self.recorder is not None and start is not None:
            self.recorder.phase(phase, start, start + seconds, nbytes, bucket or current_bucket.get())

    def snapshot(self, reset: bool = False) -> dict[str, PhaseStats]:
        """A copy of the counters; with ``reset`` also start the next interval at zero."""
        with self._lock:
            copy = {k: PhaseStats(v.seconds, v.bytes, v.calls) for k, v in self._stats.items()}
            if reset:
                self._stats = {name: PhaseStats() for name in PHASES}
        return copy

    def reset(self) -> None:
        self.snapshot(reset=True)

    def total_seconds(self) -> float:
        with self._lock:
            return sum(s.seconds for s in self._stats.values())
