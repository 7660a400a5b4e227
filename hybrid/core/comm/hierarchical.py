"""Hierarchical: reduce to the node leader -> all-reduce among leaders -> broadcast in the node.

Only one rank per node touches the inter-node network, and it sends the full
tensor once through a ring of ``nnodes`` leaders: 2(n-1)/n * S bytes per NIC
instead of the 2(N-1)/N * S a flat ring of all N ranks pushes through the NIC
of every node.

Large tensors are pipelined in pieces of ``chunk_bytes``: the leader starts
the inter-node all-reduce of piece k as soon as piece k is reduced inside the
node, and broadcasts it as soon as it is back, so the intra-node phases hide
behind the (slower) inter-node one. At most ``PIPELINE_WINDOW`` pieces run
ahead in each phase, which bounds the transport's scratch memory.

Every rank follows the same schedule (:meth:`Communicator._pipeline`, shared
with ``sharded``), so each group sees its collectives in the same order
everywhere.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from hybrid.core.comm.base import Communicator
from hybrid.core.comm.counters import rooted_bytes

__all__ = ["HierarchicalCommunicator"]


class HierarchicalCommunicator(Communicator):
    name = "hierarchical"
    group_kinds = ("intra", "leaders")
    compresses_inter = True

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable, gather: bool = True) -> None:
        topo, groups = self.topology, self.groups
        local, nnodes = topo.local_world_size, topo.nnodes
        chunks = self._chunks(flat)
        allreduces: dict[int, object] = {}

        def reduce(i: int) -> list:
            if local == 1:
                return []
            return [dist.reduce(chunks[i], dst=topo.leader, group=groups.intra, async_op=True)]

        def cross(i: int) -> None:
            if topo.is_leader and nnodes > 1:
                allreduces[i] = self._start_inter(chunks[i], groups.leaders, divisor, (key, i))

        def finish(i: int) -> list:
            """Piece i is summed over all nodes: divide it on the leader, send it to the node."""
            if topo.is_leader:
                divided = i in allreduces and self._finish_inter(chunks[i], allreduces.pop(i), nnodes)
                if divisor is not None and not divided:
                    self._divide_(chunks[i], divisor)
            if local == 1:
                return []
            return [dist.broadcast(chunks[i], src=topo.leader, group=groups.intra, async_op=True)]

        self._pipeline(len(chunks), reduce=reduce, reduced=lambda i: None, cross=cross, finish=finish,
                       reduce_bytes=lambda i: rooted_bytes(chunks[i].nbytes, local),
                       broadcast_bytes=rooted_bytes(flat.nbytes, local))
