"""Parts of a checkpoint held by several ranks, into rank 0's file one piece at a time: no rank-0 funnel.

comm=diloco's checkpoint keeps each node's own weights and inner optimizer state
(the nodes differ between syncs), held by its leader, and the outer state, which
node 0's workers may hold a share each. Gathering them whole to rank 0 before
``torch.save`` gave rank 0, at each checkpoint, all of them at once. Instead
each rank with a part first sends the *shape* of it (a skeleton: its structure,
with every tensor as a meta tensor: no data), rank 0 lays the file out with
placeholders of those shapes (:mod:`hybrid.app.state.streamed_save`), and then
each sends its tensors in pieces of at most :data:`PIECE_BYTES`, one rank after
another, which rank 0 writes at their place in the file and drops. Rank 0 holds
its own part and one piece.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.app.state.to_rank0 import gather_to_rank0
from hybrid.core.untouched import untouched_tensor

__all__ = ["PIECE_BYTES", "StreamedParts", "skeleton_of", "tensors_of"]

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


class StreamedParts:
    """Every rank's part of a checkpoint (``entries()``, on rank 0: its own first, then a placeholder part for each
    other rank that has one, in rank order) and their streaming (a :class:`hybrid.app.state.streamed_save.Deferred`).
    Built on every rank (collective over the default group: each part's skeleton goes to rank 0); ``mine``: this
    rank's part, None where it has none. Rank 0 must have one."""

    def __init__(self, mine: Any | None) -> None:
        self.mine, self.rank = mine, dist.get_rank()
        skeletons = gather_to_rank0(skeleton_of(mine, _meta) if mine is not None else None)
        self._entries: list[Any] | None = None
        self._senders: list[int] = []
        if skeletons is not None:  # rank 0: its own part, then a placeholder part per other rank with one
            if skeletons[0] is None:
                raise RuntimeError("rank 0 has no part of the checkpoint: it cannot write the others'")
            self._senders = [rank for rank, skeleton in enumerate(skeletons) if rank and skeleton is not None]
            self._entries = [mine] + [skeleton_of(skeletons[rank], _placeholder) for rank in self._senders]

    def entries(self) -> list[Any] | None:
        """Rank 0: every part, in rank order (the others' as placeholders until :meth:`fill`)."""
        return self._entries

    def placeholders(self) -> list[torch.Tensor]:
        return [t for entry in (self._entries or [])[1:] for t in tensors_of(entry)]

    def fill(self, write: Callable[[torch.Tensor, torch.Tensor, int], None] | None) -> None:
        """Rank by rank, tensor by tensor, piece by piece: the part's rank sends, rank 0 receives and writes. Point
        to point over the default group (rank 0 and one other at a time, in rank order: each sender waits for
        its turn); a rank without a part has nothing to do."""
        if self.rank != 0:
            for t in tensors_of(self.mine) if self.mine is not None else []:
                flat = t.detach().reshape(-1)
                step = max(1, PIECE_BYTES // max(1, flat.element_size()))
                for start in range(0, flat.numel(), step):
                    dist.send(flat[start:start + step].contiguous(), dst=0)
            return
        inbox = untouched_tensor((PIECE_BYTES,), torch.uint8)  # one buffer for every piece, outside the heap
        for sender, entry in zip(self._senders, (self._entries or [])[1:], strict=True):
            for placeholder in tensors_of(entry):
                step = max(1, PIECE_BYTES // max(1, placeholder.element_size()))
                for start in range(0, placeholder.numel(), step):
                    count = min(placeholder.numel(), start + step) - start
                    piece = inbox[:count * placeholder.element_size()].view(placeholder.dtype)
                    dist.recv(piece, src=sender)
                    if write is not None:
                        write(placeholder, piece, start)
