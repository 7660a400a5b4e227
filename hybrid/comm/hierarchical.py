"""Hierarchical: reduce to the node leader -> all-reduce among leaders -> broadcast in the node.

Only one rank per node touches the inter-node network, and it sends the full
tensor once through a ring of ``nnodes`` leaders: 2(n-1)/n * S bytes per NIC
instead of the 2(N-1)/N * S a flat ring of all N ranks pushes through the NIC
of every node.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid.comm.base import Communicator
from hybrid.comm.counters import allreduce_bytes, rooted_bytes

__all__ = ["HierarchicalCommunicator"]


class HierarchicalCommunicator(Communicator):
    name = "hierarchical"

    def _sum_(self, flat: torch.Tensor, divisor: int | None) -> None:
        topo, groups = self.topology, self.groups
        local = topo.local_world_size
        nbytes = flat.nbytes
        if local > 1:
            with self._phase("intra_reduce", rooted_bytes(nbytes, local)):
                dist.reduce(flat, dst=topo.leader, group=groups.intra)
        if topo.is_leader:
            if topo.nnodes > 1:
                with self._phase("inter_allreduce", allreduce_bytes(nbytes, topo.nnodes)):
                    dist.all_reduce(flat, group=groups.leaders)
            if divisor is not None:
                flat.div_(divisor)
        if local > 1:
            with self._phase("intra_broadcast", rooted_bytes(nbytes, local)):
                dist.broadcast(flat, src=topo.leader, group=groups.intra)
