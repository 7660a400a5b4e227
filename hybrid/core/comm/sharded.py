"""Sharded: intra-node reduce-scatter -> per-shard cross-node all-reduce -> intra-node all-gather.

The bandwidth-optimal two-level all-reduce: every worker of a node owns one
shard, and the g shards cross the network in parallel, one per same-local-rank
"cross" group, so every worker (and on a real cluster every NIC of a multi-NIC
node) carries 1/g of the inter-node traffic.

The reduce-scatter is one ``all_to_all_single`` per piece (every worker
sends shard j of its piece to local rank j) and a local sum of the ``g``
shards each worker receives, in local-rank order; shards of unequal length (a
tensor of 7 elements over 4 workers) travel as unequal splits, with no
padding. On gloo that is faster than one ``reduce`` per shard and lighter
than ``reduce_scatter_single``, which allocates per call; likewise the
all-gather is one ``broadcast`` per shard rather than
``all_gather_into_tensor`` (figures and the command that measures them:
experiments/RESULTS.md, ``experiments/intra_collectives_ab.py``).

Large tensors are pipelined in pieces of ``chunk_bytes`` (each piece is
sharded in turn), so a piece's shard crosses the network while the next
piece is still being reduced inside the node; at most ``PIPELINE_WINDOW``
pieces run ahead per phase. Every rank follows the same schedule
(:meth:`Communicator._pipeline`, shared with ``hierarchical``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
import torch.distributed as dist

from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES, PIPELINE_WINDOW, Communicator
from hybrid.core.comm.counters import PhaseCounters, rooted_bytes
from hybrid.core.comm.groups import CommGroups

__all__ = ["NodeCommunicator", "ShardedCommunicator"]


class ShardedCommunicator(Communicator):
    name = "sharded"
    group_kinds = ("intra", "cross")
    compresses_inter = True

    def __init__(self, groups: CommGroups, counters: PhaseCounters | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none") -> None:
        super().__init__(groups, counters, chunk_bytes, inter_compression)
        if not groups.topology.is_uniform or (groups.cross is None and groups.topology.nnodes > 1):
            raise ValueError(
                f"sharded needs nodes of equal size, got node sizes {list(groups.topology.node_sizes)}"
            )

    # The node's two phases, one piece at a time (also what comm=auto times to price them).

    def start_scatter(self, piece: torch.Tensor, shards: tuple[torch.Tensor, ...], inbox: torch.Tensor) -> Any:
        """Start the reduce-scatter's exchange: shard j of ``piece`` (``shards`` = its split, one per local
        rank) goes to local rank j, and the g copies of this rank's shard arrive in ``inbox``; returns the Work."""
        local, mine = self.topology.local_world_size, shards[self.topology.local_rank].numel()
        return dist.all_to_all_single(inbox[:mine * local], piece, output_split_sizes=[mine] * local,
                                      input_split_sizes=[s.numel() for s in shards], group=self.groups.intra,
                                      async_op=True)

    def add_up(self, shards: tuple[torch.Tensor, ...], inbox: torch.Tensor) -> None:
        """Sum the copies of this rank's shard that :meth:`start_scatter` received, in local-rank order."""
        local, mine = self.topology.local_world_size, shards[self.topology.local_rank]
        if mine.numel():
            torch.sum(inbox[:mine.numel() * local].view(local, -1), dim=0, out=mine)

    def start_gather(self, shards: tuple[torch.Tensor, ...]) -> list[Any]:
        """Start the all-gather: every non-empty shard broadcast from the local rank that owns it."""
        members = self.topology.node_ranks
        return [dist.broadcast(s, src=members[j], group=self.groups.intra, async_op=True)
                for j, s in enumerate(shards) if s.numel()]

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable, gather: bool = True) -> None:
        topo, groups = self.topology, self.groups
        local, nnodes, me, window = topo.local_world_size, topo.nnodes, topo.local_rank, PIPELINE_WINDOW
        # Each pipeline piece split into one shard per local rank; only non-empty shards travel.
        chunks = self._chunks(flat)
        pieces = [torch.tensor_split(chunk, local) for chunk in chunks]
        n = len(pieces)
        allreduces: dict[int, object] = {}
        # The g copies of my shard of a piece, one from each local rank; one per piece in flight.
        longest = max((p[me].numel() for p in pieces), default=0)
        inboxes = [flat.new_empty(longest * local) for _ in range(min(window, n))] if local > 1 else []

        def reduce(i: int) -> list:
            """Reduce-scatter piece i: shard j is summed onto local rank j (waiting for every shard's exchange
            keeps a peer's failure visible here)."""
            return [self.start_scatter(chunks[i], pieces[i], inboxes[i % window])] if local > 1 else []

        def cross(i: int) -> None:
            mine = pieces[i][me]
            if mine.numel() and nnodes > 1:
                allreduces[i] = self._start_inter(mine, groups.cross, divisor, (key, i))

        def finish(i: int) -> list:
            """My shard of piece i is summed over all nodes: divide it, all-gather the piece (unless a
            node-sharded optimizer gathers parameters instead: ``gather=False``)."""
            mine = pieces[i][me]
            divided = i in allreduces and self._finish_inter(mine, allreduces.pop(i), nnodes)
            if divisor is not None and mine.numel() and not divided:
                self._divide_(mine, divisor)
            return self.start_gather(pieces[i]) if local > 1 and gather else []

        self._pipeline(n, reduce=reduce, reduced=lambda i: self.add_up(pieces[i], inboxes[i % window]),
                       cross=cross, finish=finish,
                       reduce_bytes=lambda i: rooted_bytes(sum(s.nbytes for s in pieces[i]), local),
                       broadcast_bytes=rooted_bytes(flat.nbytes, local))


class NodeCommunicator(ShardedCommunicator):
    """``sharded`` inside one node only: the reduce-scatter and all-gather over the node's workers, no inter-node
    phase. What a node-sharded optimizer averages and gathers over where the nodes train apart between meetings
    (comm=diloco's inner steps, whose outer loop crosses nodes on its own). ``groups``: any groups with the
    intra-node one (:meth:`CommGroups.inside_node` is applied here)."""

    name = "node"
    group_kinds = ("intra",)

    def __init__(self, groups: CommGroups, counters: PhaseCounters | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(groups.inside_node(), counters, chunk_bytes)
