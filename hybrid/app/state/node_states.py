"""Every node's state into rank 0's checkpoint file, one piece at a time: no rank-0 funnel.

comm=diloco's checkpoint keeps each node's own weights, inner optimizer state and
outer state (the nodes differ between syncs). Gathering them whole to rank 0
before ``torch.save`` gave rank 0, at each checkpoint, every node's state at
once. Instead each node leader first sends the *shape* of its state (a
skeleton: its structure, with every tensor as a meta tensor: no data), rank 0
lays the file out with placeholders of those shapes
(:mod:`hybrid.app.state.streamed_save`), and then each leader sends its tensors
in pieces of at most :data:`PIECE_BYTES`, one node after another, which rank 0
writes at their place in the file and drops. Rank 0 holds its own state and one
piece.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.app.state.to_rank0 import gather_to_rank0
from hybrid.core.untouched import untouched_tensor

__all__ = ["PIECE_BYTES", "StreamedNodeStates", "skeleton_of", "tensors_of"]

PIECE_BYTES = 4 << 20


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a state (dicts in their order, lists and tuples), depth first: the same order for a state
    and its skeleton."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in tensors_of(value)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in tensors_of(value)]
    return []


def skeleton_of(obj: Any, make: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``make(t)``, everything else as it is."""
    if torch.is_tensor(obj):
        return make(obj)
    if isinstance(obj, dict):
        return type(obj)((key, skeleton_of(value, make)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(skeleton_of(value, make) for value in obj)
    return obj


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _placeholder(t: torch.Tensor) -> torch.Tensor:
    # Never touched: address space until streamed_save writes the file around it.
    return untouched_tensor(t.shape, t.dtype)


class StreamedNodeStates:
    """The node states of a checkpoint (``entries()``, on rank 0: rank 0's own first, placeholders for the others)
    and their streaming (a :class:`hybrid.app.state.streamed_save.Deferred`). Built on every rank (collective over
    the default group: each leader's skeleton goes to rank 0); ``mine``: this rank's node state where it is its
    node's leader, else None."""

    def __init__(self, mine: Any | None, leaders: list[int]) -> None:
        self.mine, self.leaders, self.rank = mine, leaders, dist.get_rank()
        skeletons = gather_to_rank0(skeleton_of(mine, _meta) if mine is not None else None)
        self._entries: list[Any] | None = None
        if skeletons is not None:  # rank 0: its own state, then a placeholder state per other leader
            if skeletons[0] is None:
                raise RuntimeError("rank 0 is not its node's leader: it cannot write the nodes' states")
            self._entries = [mine] + [skeleton_of(skeletons[leader], _placeholder) for leader in leaders[1:]]

    def entries(self) -> list[Any] | None:
        """Rank 0: every node's state, in node order (the others' as placeholders until :meth:`fill`)."""
        return self._entries

    def placeholders(self) -> list[torch.Tensor]:
        return [t for entry in (self._entries or [])[1:] for t in tensors_of(entry)]

    def fill(self, write: Callable[[torch.Tensor, torch.Tensor, int], None] | None) -> None:
        """Node by node, tensor by tensor, piece by piece: the node's leader sends, rank 0 receives and writes.
        Point to point over the default group (rank 0 and one leader at a time); a rank that is neither has
        nothing to do."""
        for node, leader in enumerate(self.leaders[1:], start=1):
            if self.rank == leader:
                for t in tensors_of(self.mine):
                    flat = t.detach().reshape(-1)
                    for start in range(0, flat.numel(), max(1, PIECE_BYTES // max(1, flat.element_size()))):
                        end = min(flat.numel(), start + max(1, PIECE_BYTES // max(1, flat.element_size())))
                        dist.send(flat[start:end].contiguous(), dst=0)
            elif self.rank == 0:
                inbox = untouched_tensor((PIECE_BYTES,), torch.uint8)  # one buffer for every piece, outside the heap
                for placeholder in tensors_of(self._entries[node]):
                    step = max(1, PIECE_BYTES // max(1, placeholder.element_size()))
                    for start in range(0, placeholder.numel(), step):
                        count = min(placeholder.numel(), start + step) - start
                        piece = inbox[:count * placeholder.element_size()].view(placeholder.dtype)
                        dist.recv(piece, src=leader)
                        if write is not None:
                            write(placeholder, piece, start)
