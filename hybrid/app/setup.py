"""Everything a rank (process mode) or a node (thread mode) builds before its first step, the same way in both.

Dataset, model, optimizer and schedule, one batch stream per replica this
process drives, and the state of a checkpoint to continue from: built by
:func:`set_up` in one order, so both modes start from the same weights and
the same data position, and a checkpoint of one resumes in the other.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from hybrid.app import error_feedback
from hybrid.app.checkpoint import checkpoint_steps, load_checkpoint
from hybrid.app.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, TrainerConfig, resume_target
from hybrid.app.data import (
    KIND_OF_MODEL,
    ArrayDataset,
    BatchStream,
    DatasetSpec,
    check_arrays,
    ensure_synthetic,
    load_arrays,
    text_arrays,
)
from hybrid.app.metrics import Metrics
from hybrid.app.models import build_model
from hybrid.app.optim import build_optimizer, build_scheduler
from hybrid.runtime.distributed import broadcast_from_rank0

__all__ = ["Training", "build_training", "device_for", "load_dataset", "restore_training", "sample_batch", "set_up"]


def device_for(trainer: TrainerConfig, local_rank: int) -> torch.device:
    """The device ``trainer.device`` asks for: this local rank's GPU, or the CPU."""
    want = trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def load_dataset(d: DataConfig, model_name: str) -> ArrayDataset:
    """The dataset ``d`` describes (generating synthetic data on first use), checked against the model."""
    if d.name == "synthetic":
        spec = DatasetSpec(KIND_OF_MODEL[model_name], d.num_samples, d.features, d.classes,
                           d.image_size, d.vocab_size, d.seq_len, d.seed)
        inputs, targets = ensure_synthetic(Path(d.root), spec)
        x, y = load_arrays(inputs, targets)
        where = f"synthetic data {inputs.parent}"
    elif d.name == "text":
        x, y = text_arrays(list(d.text_files), d.seq_len)
        where = f"data.text_files={list(d.text_files)!r}"
    else:
        x, y = load_arrays(d.inputs, d.targets or None)
        where = f"data.inputs={d.inputs!r}"
    check_arrays(x, y, model_name, d.classes, d.vocab_size, where)
    return ArrayDataset(x, y)


def sample_batch(dataset: ArrayDataset, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's first ``batch_size`` rows: a batch of the right shapes that consumes no stream."""
    rows = [dataset[i] for i in range(min(batch_size, len(dataset)))]
    return torch.stack([x for x, _ in rows]).to(device), torch.stack([y for _, y in rows]).to(device)


def build_training(m: ModelConfig, d: DataConfig, optim: OptimConfig, trainer: TrainerConfig, dataset: ArrayDataset,
                   device: torch.device) -> tuple[nn.Module, Any, Any]:
    """Model, optimizer and LR schedule; the same initial weights in every process (``trainer.seed``)."""
    torch.manual_seed(trainer.seed)  # same initial weights on every rank
    model = build_model(m.name, width=m.width, depth=m.depth, channels=m.channels, heads=m.heads,
                        input_shape=tuple(dataset[0][0].shape), classes=d.classes, vocab_size=d.vocab_size,
                        seq_len=d.seq_len).to(device)
    optimizer = build_optimizer(model.parameters(), optim)
    scheduler = build_scheduler(optimizer, optim, trainer.max_steps)
    return model, optimizer, scheduler


def _check_resumable(state: dict[str, Any], model: ModelConfig, world: int, where: Path) -> None:
    saved_model, saved_world = state.get("model_config"), state.get("world_size")
    if saved_model != asdict(model):
        raise ValueError(f"trainer.resume={str(where)!r} holds model {saved_model}, this run has {asdict(model)}")
    if saved_world != world:
        raise ValueError(f"trainer.resume={str(where)!r} was written by world size {saved_world}, this run has {world}")


def restore_training(trainer: TrainerConfig, model_config: ModelConfig, run_path: Path, rank: int, world_size: int,
                     metrics: Metrics, model: nn.Module, optimizer: Any, scheduler: Any,
                     streams: Sequence[BatchStream], residual_signature: dict[str, Any] | None = None,
                     ) -> tuple[int, dict[str, Any] | None]:
    """Load ``trainer.resume``'s checkpoint (or, after an elastic restart, this run's last one) into these
    objects; return the step to start at (0: a fresh run) and this rank's error-feedback residuals where
    the checkpoint has them for a run of signature ``residual_signature`` (see :mod:`hybrid.app.error_feedback`;
    None: this run does not compress). Collective over the default group."""
    start_step, mine = 0, None
    source = resume_target(trainer.resume, run_path)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart:
        # The elastic agent restarted us after a failure: continue from this run's last
        # checkpoint if it wrote one. Rank 0 owns the run dir, so rank 0 decides for all.
        own = rank == 0 and bool(checkpoint_steps(run_path / "checkpoints"))
        if broadcast_from_rank0(own):
            source = run_path
            metrics.status(f"restart {restart}: resuming from the last checkpoint in {run_path / 'checkpoints'}")
    if source is not None:
        state = load_checkpoint(source, log=metrics.status) if rank == 0 else None
        # Every rank's residuals stay on rank 0 until each gets only its own, below.
        saved_residuals = state.pop(error_feedback.CHECKPOINT_KEY, None) if state is not None else None
        state = broadcast_from_rank0(state)
        _check_resumable(state, model_config, world_size, source)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        for stream in streams:  # every rank's stream stands at the same (epoch, batch)
            stream.restore(state["data"])
        torch.set_rng_state(state["rng"])
        start_step = int(state["step"])
        mine = error_feedback.restore_residuals(saved_residuals, residual_signature, metrics.status)
        metrics.status(f"resumed from step {start_step} of {source}")
    return start_step, mine


@dataclass
class Training:
    """What :func:`set_up` built: the leader model (on the first device) and its optimizer and schedule, one
    batch stream per replica, the step to start at, and this process's restored error-feedback residuals."""

    dataset: ArrayDataset
    model: nn.Module
    optimizer: Any
    scheduler: Any
    streams: list[BatchStream]
    start_step: int
    residual_signature: dict[str, Any] | None
    residuals: dict[str, Any] | None


def set_up(cfg: TrainConfig, stream_ranks: Sequence[int], world_size: int, node_sizes: Sequence[int],
           device: torch.device, run_path: Path, metrics: Metrics, process_rank: int) -> Training:
    """Build a run's training state for the replicas of global ranks ``stream_ranks`` (one in process mode,
    a node's in thread mode), restoring a checkpoint where the run resumes. Collective over the default
    group (``process_rank`` is this process's rank there)."""
    dataset = load_dataset(cfg.data, cfg.model.name)
    model, optimizer, scheduler = build_training(cfg.model, cfg.data, cfg.optim, cfg.trainer, dataset, device)
    streams = [BatchStream(dataset, cfg.data.batch_size, rank, world_size, cfg.trainer.seed,
                           pin_memory=device.type == "cuda", num_workers=cfg.data.num_workers)
               for rank in stream_ranks]
    signature = error_feedback.signature(cfg.comm, cfg.cluster.intra_mode, node_sizes)
    start_step, residuals = restore_training(cfg.trainer, cfg.model, run_path, process_rank, world_size, metrics,
                                             model, optimizer, scheduler, streams, signature)
    return Training(dataset, model, optimizer, scheduler, streams, start_step, signature, residuals)
