"""Flat: one all-reduce over every rank, the baseline every other algorithm is judged against."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.comm.base import Communicator
from hybrid.comm.counters import allreduce_bytes

__all__ = ["FlatCommunicator"]


class FlatCommunicator(Communicator):
    name = "flat"

    def _sum_(self, flat: torch.Tensor, divisor: int | None) -> None:
        world = self.topology.world_size
        with self._phase("flat_allreduce", allreduce_bytes(flat.nbytes, world)):
            dist.all_reduce(flat, group=self.groups.world)
        if divisor is not None:
            flat.div_(divisor)
