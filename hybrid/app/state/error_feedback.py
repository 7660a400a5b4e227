"""Carry every rank's error-feedback residuals through a checkpoint, so a compressed run resumes exactly.

With ``comm.inter_compression`` each rank that sends across nodes keeps what
16-bit rounding dropped (see :mod:`hybrid.core.comm.compression`): a hierarchical
leader for the whole gradient, each sharded worker for its shard. That state
is per rank, while rank 0 alone writes checkpoints (other nodes need not
share its disk). So at a checkpoint every rank sends its residuals to rank 0
(point to point over the default group, each message as long as what that
rank holds), which stores them by rank; on resume rank 0 sends each rank its
own back. A compressed run's checkpoint is therefore larger by one fp32 copy
of the gradient per node (the leader's, or the node's shards together).

Residuals are keyed by DDP bucket and pipeline piece, which depend on the
algorithm, the node layout, the bucket and chunk sizes and the intra mode;
they are restored only where all of these match (the :func:`signature`),
and otherwise start at zero, as in a fresh run, with a status line saying
why. Bucket keys are stable because the trainer lets DDP rebuild its buckets
before the first step (:func:`hybrid.core.comm.settle_buckets`); restored, a
resumed run ends bit-identical to an uninterrupted one (with ``comm=auto``,
where its fresh calibration chooses the same algorithm per bucket size again:
each algorithm keeps its own residuals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from hybrid.app.config import CommConfig
from hybrid.app.state.to_rank0 import gather_to_rank0, scatter_from_rank0
from hybrid.core.adaptive import Mode
from hybrid.core.comm.compression import InterCompressor
from hybrid.runtime.distributed import broadcast_from_rank0

__all__ = ["ErrorFeedback", "HasCompressors", "restore_residuals", "signature"]

CHECKPOINT_KEY = "error_feedback"


def signature(comm: CommConfig, intra_mode: str, node_sizes: Sequence[int]) -> dict[str, Any] | None:
    """What the residuals' keys and owners depend on: equal signatures mean they apply as saved. None where
    the run keeps no residuals (no ``inter_compression``; the same on every rank: it is the config)."""
    where = {"intra_mode": intra_mode, "node_sizes": list(node_sizes), "bucket_mb": comm.bucket_mb,
             "chunk_bytes": comm.chunk_bytes}
    if comm.algorithm == "adaptive":  # its 16-bit modes keep theirs, one set per mode, through every switch
        compressed = [str(m) for m in comm.adapt_modes if Mode.parse(m).inter_compression != "none"]
        return {"comm": comm.algorithm, "modes": compressed, **where} if compressed else None
    if comm.inter_compression == "none" or comm.algorithm == "diloco":  # diloco's pseudo-gradients keep none
        return None
    return {"comm": comm.algorithm, "inter_compression": comm.inter_compression, **where}


class HasCompressors(Protocol):
    """What keeps error-feedback residuals: a communicator, or comm=adaptive's replica (every 16-bit mode's)."""

    def compressors(self) -> dict[str, InterCompressor]: ...


@dataclass
class ErrorFeedback:
    """This rank's compressors (by algorithm name) and the run's :func:`signature`."""

    compressors: dict[str, InterCompressor]
    signature: dict[str, Any]

    @classmethod
    def attach(cls, run_signature: dict[str, Any] | None, comm: HasCompressors | None,
               residuals: dict[str, Any] | None, device: torch.device) -> ErrorFeedback | None:
        """The error feedback of a run of ``run_signature`` (None where it keeps none) over ``comm``'s
        compressors (a communicator's, or comm=adaptive's replica's: every 16-bit mode's), with this rank's
        restored ``residuals`` (from :func:`restore_residuals`) loaded."""
        if run_signature is None or comm is None:
            return None
        feedback = cls(comm.compressors(), run_signature)
        if residuals is not None:
            feedback.load(residuals, device)
        return feedback

    def gather(self) -> dict[str, Any] | None:
        """Every rank's residuals, on rank 0 (None elsewhere). Collective over the default group."""
        ranks = gather_to_rank0({name: c.state_dict() for name, c in self.compressors.items()})
        return {"signature": self.signature, "ranks": ranks} if ranks is not None else None

    def load(self, mine: dict[str, Any], device: torch.device) -> None:
        """Take over this rank's part of a checkpoint (from :func:`restore_residuals`)."""
        for name, state in mine.items():
            if name in self.compressors:
                self.compressors[name].load_state_dict(state, device)


def _verdict(saved: dict[str, Any] | None, wanted: dict[str, Any] | None) -> str | None:
    """Why the saved residuals cannot be restored into this run (None: they can)."""
    if wanted is None:
        return "this run does not compress" if saved is not None else "nothing to restore"
    if saved is None:
        return "the checkpoint has none (written without inter_compression, or by an older version)"
    if saved["signature"] != wanted:
        return f"they were kept by {saved['signature']}, this run is {wanted}"
    if len(saved["ranks"]) != dist.get_world_size():
        return f"they come from {len(saved['ranks'])} processes, this run has {dist.get_world_size()}"
    return None


def restore_residuals(saved: dict[str, Any] | None, wanted: dict[str, Any] | None,
                      log: Callable[[str], None]) -> dict[str, Any] | None:
    """This rank's residuals out of the checkpoint part ``saved`` (significant on rank 0 only), or None
    where they do not apply to a run of signature ``wanted`` (None: the run does not compress).
    Collective over the default group."""
    why = broadcast_from_rank0(_verdict(saved, wanted) if dist.get_rank() == 0 else None)
    if why is not None:
        if wanted is not None:
            log(f"error-feedback residuals start at zero: {why}")
        return None
    return scatter_from_rank0(saved["ranks"] if dist.get_rank() == 0 else None)
