"""What the training loop steps: this rank's DDP model, or (thread mode) a node's replicas; and the checks that
every replica still holds the same parameters."""

from __future__ import annotations

import hashlib
import sys
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.app.components.data import BatchStream
from hybrid.app.components.losses import LossFn, batch_loss, move_to
from hybrid.core.timeline import StepRecorder

__all__ = ["SHARDED_STATE_KIND", "PlainState", "RankReplica", "ReplicaDivergence", "Replicas", "StateAccess", "accumulate",
           "autocast_for", "check_replicas", "grads_finite", "is_sharded", "local_part", "param_checksum"]


def autocast_for(device: torch.device, precision: str) -> Any:
    """``trainer.precision``: bf16 runs the forward and loss under autocast (matmuls in bf16); the weights, and
    so the gradients DDP averages, stay fp32. fp32 changes nothing."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def accumulate(model: nn.Module, accum: int, stream: BatchStream, device: torch.device, loss_fn: LossFn,
               precision: str, rec: StepRecorder, sync: Callable[[bool], ContextManager[Any]]) -> torch.Tensor:
    """One step's ``accum`` micro-steps on this rank: each batch to the device, forward and loss under
    autocast, backward inside ``sync(last micro-step)`` (the model's own way to hold gradients back until
    the last one); returns the step's loss. Spans: data, forward, backward."""
    total_loss = torch.zeros((), device=device)
    for micro in range(accum):
        with rec.span("data"):
            x, y = next(stream)
            x, y = move_to(x, device, non_blocking=True), move_to(y, device, non_blocking=True)
        with sync(micro == accum - 1):
            with rec.span("forward"), autocast_for(device, precision):
                loss = batch_loss(model, x, y, loss_fn) / accum
            rec.backward(loss)
        total_loss += loss.detach()
    return total_loss


class Replicas(Protocol):
    """What the loop steps: this rank's DDP model (:class:`RankReplica`), or a node's replicas driven by
    one process (``cluster.intra_mode=thread``, :class:`hybrid.app.replicas.node_threads.NodeReplicas`)."""

    module: nn.Module  # the parameters the optimizer steps, checkpoints and checksums see
    # Ranks with the same shard_index must hold bit-identical parameters: all of them (0) where every rank
    # holds the whole model; under comm=hsdp, the ranks holding the same shard (one per node).
    shard_index: int

    def forward_backward(self, accum: int) -> torch.Tensor:
        """Every micro-step of one step, leaving gradients averaged over all ranks in ``module``;
        returns this (leading) rank's loss, summed over the micro-steps."""

    def end_step(self) -> None:
        """After the optimizer step (taken or skipped) and zero_grad."""

    def local_models(self) -> list[nn.Module]:
        """The replicas this process holds, in global rank order."""


class StateAccess(Protocol):
    """How a run's model and optimizer state is read for a checkpoint and loaded from one: torch's
    ``state_dict`` methods (:class:`PlainState`), or torch's distributed state-dict API for a sharded model
    (:class:`hybrid.app.replicas.hsdp.ShardedState`). ``kind`` is recorded in the checkpoint: a resume must load it
    the way it was written."""

    kind: str

    def prepare(self, model: nn.Module) -> nn.Module:
        """The model as the optimizer must see it (sharded, where this access shards). Collective."""

    def collect(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state dicts, complete on rank 0. Collective."""

    def load(self, model: nn.Module, optimizer: Any, model_state: dict[str, Any],
             optimizer_state: dict[str, Any]) -> None:
        """Load full state dicts (every rank has them)."""

    def extra(self) -> dict[str, Any]:
        """Entries of the checkpoint besides model and optimizer, from the last ``collect`` (rank 0's)."""

    def deferred(self) -> Any:
        """Tensors of the last ``collect``'s entries that arrive while rank 0 writes the file (a
        :class:`hybrid.app.state.streamed_save.Deferred`; its ``fill`` runs on every rank), or None."""


# state_dict_kind of a checkpoint written through torch's distributed state-dict API (comm=hsdp: optimizer state
# keyed by parameter name, where torch's Optimizer.state_dict keys it by position): which loader a resume needs.
SHARDED_STATE_KIND = "torch.distributed.checkpoint"


class PlainState:
    """Every rank holds the whole model: its own ``state_dict`` methods; nothing to exchange."""

    kind = "torch.nn.Module"

    def prepare(self, model: nn.Module) -> nn.Module:
        return model

    def collect(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if _is_zero_redundancy(optimizer):  # torch's ZeroRedundancyOptimizer (comm=ddp, comm.shard_optimizer)
            optimizer.consolidate_state_dict(to=0)
            return model.state_dict(), optimizer.state_dict() if dist.get_rank() == 0 else {}
        return model.state_dict(), optimizer.state_dict()

    def load(self, model: nn.Module, optimizer: Any, model_state: dict[str, Any],
             optimizer_state: dict[str, Any]) -> None:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def extra(self) -> dict[str, Any]:
        return {}

    def deferred(self) -> Any:
        """What of the last :meth:`collect`'s checkpoint arrives while rank 0 writes it (a
        :class:`hybrid.app.state.streamed_save.Deferred`), or None: everything is in hand."""
        return None


class RankReplica:
    """Process mode: one replica per process, this rank's model under DDP."""

    shard_index = 0

    def __init__(self, ddp: DDP, stream: BatchStream, device: torch.device, loss_fn: LossFn,
                 precision: str = "fp32", recorder: StepRecorder | None = None, compile: bool = False) -> None:
        self.ddp, self.stream, self.device, self.precision = ddp, stream, device, precision
        self.loss_fn = loss_fn
        # trainer.compile: forward through torch.compile'd DDP, as torch documents it (its DDPOptimizer splits the
        # graph at DDP's buckets, so each bucket's gradients still leave as backward reaches them); the comm hook,
        # no_sync and the parameters are DDP's own. The first step pays the compile.
        self.forward_model: nn.Module = torch.compile(ddp) if compile else ddp
        self.recorder = recorder if recorder is not None else StepRecorder(())
        self.recorder.watch_gradients(ddp.module)  # backward's compute ends at its last accumulated gradient

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def forward_backward(self, accum: int) -> torch.Tensor:
        # Only the last micro-step synchronises gradients.
        return accumulate(self.forward_model, accum, self.stream, self.device, self.loss_fn, self.precision,
                          self.recorder, lambda last: nullcontext() if last else self.ddp.no_sync())

    def end_step(self) -> None:
        pass  # every rank stepped its own replica with the same averaged gradients

    def close(self) -> None:
        """Remove the gradient hooks (also where training failed)."""
        self.recorder.close()

    def local_models(self) -> list[nn.Module]:
        return [self.ddp.module]


def param_checksum(model: nn.Module) -> str:
    """sha256 over the exact bits of every parameter: equal strings mean bit-identical replicas. Buffers are
    not in it: as in plain DDP, every forward starts from rank 0's (BatchNorm's running statistics are
    broadcast), and each rank then updates its copy with its own batch."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local_part(p).detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def is_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor (comm=hsdp). Looked up where torch.distributed.tensor is already loaded (comm=hsdp loads it):
    importing it costs every worker process CPU time (experiments/RESULTS.md) that the other comms need not pay."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _is_zero_redundancy(optimizer: Any) -> bool:
    """torch's ZeroRedundancyOptimizer, looked up only where its module is loaded (as :func:`is_sharded`)."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded tensor (comm=hsdp's DTensors); the tensor itself where it is whole."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def grads_finite(model: nn.Module) -> bool:
    """True if no gradient holds inf or NaN (one reduction per tensor, one sync). Sharded gradients (each
    rank sees its shard only) add one all-reduce of the verdict, so every rank decides alike."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sums = [local_part(g).sum() for g in grads]
    finite = not sums or bool(torch.stack(sums).isfinite().all())
    if any(is_sharded(g) for g in grads):
        bad = torch.tensor([0.0 if finite else 1.0], device=sums[0].device)
        dist.all_reduce(bad)
        finite = bad.item() == 0
    return finite


class ReplicaDivergence(RuntimeError):
    """Ranks that should hold identical parameters do not."""


def check_replicas(model: nn.Module | Sequence[nn.Module], step: int, shard_index: int = 0) -> None:
    """Compare parameter checksums across ranks; raise on every rank, naming the ranks that differ.

    ``model`` may be this process's replicas in global rank order (intra_mode=thread: a node's
    replicas, one process per node): ranks are then numbered across all of them. Ranks compare with
    those of the same ``shard_index`` (comm=hsdp: the holders of one shard, one per node)."""
    mine = [param_checksum(m) for m in ([model] if isinstance(model, nn.Module) else model)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (shard_index, mine))
    every = [(index, digest) for index, digests in gathered for digest in digests]
    for index in sorted({i for i, _ in every}):
        groups: dict[str, list[int]] = {}
        for r, (i, digest) in enumerate(every):
            if i == index:
                groups.setdefault(digest, []).append(r)
        if len(groups) > 1:
            majority = max(groups.values(), key=len)
            diverged = sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)
            raise ReplicaDivergence(
                f"step {step}: replicas diverged: rank(s) {diverged} hold parameters different from "
                f"rank(s) {majority}; stopping (trainer.check_replicas_every)"
            )
