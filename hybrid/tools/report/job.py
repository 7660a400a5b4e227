"""One job of a sweep as the report reads it: what ran (comm, cluster layout, model, DDP bucket size, network)
and what it measured (its metrics.json), with the per-step figures every table, headline and plot derives from.

Kept apart from the reading of Hydra's files (:mod:`hybrid.tools.report`) so that the parts of the report can
share one Job without importing the entry point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid.core.topology import Layout

__all__ = ["LOOPBACK", "PHASE_COLUMNS", "Job", "is_reference", "split_buckets"]

PHASE_COLUMNS = ("intra_reduce", "inter_allreduce", "intra_broadcast", "flat_allreduce")
LOOPBACK = "no network limit (loopback)"


@dataclass
class Job:
    path: Path
    comm: str
    layout: Layout
    model: str
    bucket_mb: float
    metrics: dict[str, Any] | None = None
    predicted_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    network: str = LOOPBACK  # what carried the inter-node traffic, in words (the plots' titles, the headlines)
    link_mbit: list[float] | None = None  # testbed: each node's NIC rate, Mbit/s
    nics_per_node: int = 1

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    @property
    def steps(self) -> int:
        return max(1, int(self.metrics.get("steps_run", self.metrics["steps"]))) if self.metrics else 1

    @property
    def step_s(self) -> float:
        return float(self.metrics["mean_step_s"]) if self.metrics else math.nan

    def phase_s(self, phase: str) -> float:
        return self.metrics["comm_s"].get(phase, 0.0) / self.steps if self.metrics else math.nan

    @property
    def comm_per_step_s(self) -> float:
        return sum(self.phase_s(p) for p in PHASE_COLUMNS) if self.metrics else math.nan

    @property
    def buckets(self) -> list[float]:
        """DDP buckets of this model, as sizes in bytes (the communicator's unit of work)."""
        full, rest = split_buckets(float(self.metrics["param_bytes"]) if self.metrics else 0.0, self.bucket_mb)
        return [self.bucket_mb * 2**20] * full + ([rest] if rest else [])

    def wire_s(self) -> float | None:
        """Seconds the busiest node's NICs need at the link rate for the bytes they sent per step (a lower bound
        on its communication), or None off the testbed or without NIC counts."""
        by_node = (self.metrics or {}).get("nic_tx_bytes_per_step_by_node")
        if not self.link_mbit or not by_node:
            return None
        rates = self.link_mbit if len(self.link_mbit) == len(by_node) else [min(self.link_mbit)] * len(by_node)
        return max(b * 8 / (r * 1e6 * self.nics_per_node) for b, r in zip(by_node, rates))


def split_buckets(total: float, bucket_mb: float) -> tuple[int, float]:
    """``total`` gradient bytes as DDP buckets of ``bucket_mb``: (full buckets, bytes of the last partial one)."""
    full, rest = divmod(total, bucket_mb * 2**20)
    return int(full), rest


def is_reference(comm: str) -> bool:
    """torch's own communication (plain DDP, its hooks, FSDP2): no hybrid phases to show."""
    return comm.split("+")[0] in ("ddp", "hsdp")
