"""Hierarchical: reduce to the node leader -> all-reduce among leaders -> broadcast in the node.

Only one rank per node touches the inter-node network, and it sends the full
tensor once through a ring of ``nnodes`` leaders: 2(n-1)/n * S bytes per NIC
instead of the 2(N-1)/N * S a flat ring of all N ranks pushes through the NIC
of every node.

Large tensors are pipelined in pieces of ``chunk_bytes``: the leader starts
the inter-node all-reduce of piece k as soon as piece k is reduced inside the
node, and broadcasts it as soon as it is back, so the intra-node phases hide
behind the (slower) inter-node one. Each group sees its collectives in the
same order on every rank: all reduces, then all broadcasts (intra), and the
all-reduces in piece order (leaders).
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
        local, nnodes = topo.local_world_size, topo.nnodes
        chunks = self._chunks(flat)
        reduces = []
        if local > 1:
            reduces = [dist.reduce(c, dst=topo.leader, group=groups.intra, async_op=True) for c in chunks]
        if topo.is_leader:
            allreduces = []
            for i, chunk in enumerate(chunks):
                if reduces:
                    self._wait("intra_reduce", [reduces[i]], rooted_bytes(chunk.nbytes, local))
                if nnodes > 1:
                    allreduces.append(dist.all_reduce(chunk, group=groups.leaders, async_op=True))
            broadcasts = []
            for i, chunk in enumerate(chunks):
                if allreduces:
                    self._wait("inter_allreduce", [allreduces[i]], allreduce_bytes(chunk.nbytes, nnodes))
                if divisor is not None:
                    chunk.div_(divisor)
                if local > 1:
                    broadcasts.append(dist.broadcast(chunk, src=topo.leader, group=groups.intra, async_op=True))
        else:
            self._wait("intra_reduce", reduces, rooted_bytes(flat.nbytes, local))
            broadcasts = [dist.broadcast(c, src=topo.leader, group=groups.intra, async_op=True) for c in chunks]
        if broadcasts:
            self._wait("intra_broadcast", broadcasts, rooted_bytes(flat.nbytes, local))
