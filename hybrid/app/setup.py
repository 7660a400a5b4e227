"""Everything a rank (process mode) or a node (thread mode) builds before its first step, the same way in both.

Dataset, model, optimizer and schedule, one batch stream per replica this
process drives, and the state of a checkpoint to continue from: built by
:func:`set_up` in one order, so both modes start from the same weights and
the same data position, and a checkpoint of one resumes in the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from hybrid.app.components.data import BatchStream
from hybrid.app.components.losses import LossFn, move_to
from hybrid.app.components.models import param_bytes
from hybrid.app.components.optim import build_optimizer, build_scheduler, parameter_groups
from hybrid.app.config import COMM_ALGORITHMS, CommConfig, DataConfig, OptimConfig, TrainConfig, TrainerConfig, resume_target
from hybrid.app.observability.metrics import Metrics
from hybrid.app.observability.run_log import describe_run
from hybrid.app.replicas.adaptive import CHECKPOINT_KEY as ADAPTIVE_KEY
from hybrid.app.replicas.base import SHARDED_STATE_KIND, PlainState, StateAccess
from hybrid.app.replicas.diloco import CHECKPOINT_KEY as DILOCO_KEY
from hybrid.app.state import error_feedback
from hybrid.app.state.checkpoint import checkpoint_steps, load_checkpoint
from hybrid.app.state.in_memory import HELD_OUTER_KEY, HeldState, Progress
from hybrid.app.state.membership import RunLayout, apply_lr_policy, describe_change, history_after_resume, start_history
from hybrid.app.targets import Component, ComponentError, current_target, first_line
from hybrid.runtime.distributed import all_gather_object, broadcast_from_rank0
from hybrid.runtime.slurm import slurm_restart

__all__ = ["Training", "build_loss", "build_model", "build_training", "device_for", "load_dataset", "optimizer_sharding", "restore_training",
           "sample_batch", "set_up"]


def device_for(trainer: TrainerConfig, local_rank: int) -> torch.device:
    """The device ``trainer.device`` asks for: this local rank's GPU, or the CPU."""
    want = trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def load_dataset(d: DataConfig) -> Dataset:
    """The dataset ``data._target_`` builds (a built-in one generates its data on first use): map-style, of
    ``(input, target)`` pairs, at least one of them. Raises one line otherwise."""
    built = d.dataset.build()
    if callable(built) and not hasattr(built, "__getitem__"):
        built = _call(d.dataset, built)  # a factory (a _partial_ target, a class): it builds the dataset
    for need in ("__getitem__", "__len__"):
        if not hasattr(built, need):
            raise ComponentError(f"data._target_={d.dataset.target} gave a {type(built).__name__}, not a map-style "
                                 f"torch.utils.data.Dataset (it has no {need})")
    if len(built) == 0:
        raise ComponentError(f"data._target_={d.dataset.target} gave an empty dataset (0 samples)")
    sample = built[0]
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise ComponentError(f"data._target_={d.dataset.target}: a sample is a {type(sample).__name__}, not an "
                             "(input, target) pair")
    return built


def _call(component: Component, factory: Any) -> Any:
    try:
        return factory()
    except Exception as exc:
        raise ComponentError(f"{component.key}._target_={component.target} gave a callable that failed when called "
                             f"with no arguments: {type(exc).__name__}: {first_line(exc)}") from exc


def sample_batch(dataset: Dataset, batch_size: int, device: torch.device) -> tuple[Any, Any]:
    """The dataset's first ``batch_size`` samples, collated as the loader collates them: a batch of the right
    shapes that consumes no stream."""
    rows = [dataset[i] for i in range(min(batch_size, len(dataset)))]
    x, y = default_collate(rows)
    return move_to(x, device), move_to(y, device)


def build_model(model: Component, device: torch.device) -> nn.Module:
    """``model._target_``'s module on ``device``; refuses anything but an ``nn.Module``."""
    built = model.build()
    if not isinstance(built, nn.Module):
        raise ComponentError(f"model._target_={model.target} gave a {type(built).__name__}, not a torch.nn.Module")
    return built.to(device)


def build_loss(loss: Component) -> LossFn:
    built = loss.build()
    if not callable(built):
        raise ComponentError(f"loss._target_={loss.target} gave a {type(built).__name__}, not a callable "
                             "(output, target) -> loss: a function needs _partial_: true")
    return built


def build_training(model_cfg: Component, optim: OptimConfig, trainer: TrainerConfig, device: torch.device,
                   state: StateAccess | None = None, shard_optimizer: str = "none") -> tuple[nn.Module, Any, Any]:
    """Model, optimizer and LR schedule; the same initial weights in every process (``trainer.seed``).
    ``state`` prepares the model before the optimizer sees its parameters (comm=hsdp shards it);
    ``shard_optimizer``: how the optimizer is sharded (:func:`hybrid.app.components.optim.build_optimizer`)."""
    torch.manual_seed(trainer.seed)  # same initial weights on every rank
    model = (state or PlainState()).prepare(build_model(model_cfg, device))
    optimizer = build_optimizer(parameter_groups(model, optim.no_decay), optim, shard=shard_optimizer)
    scheduler = build_scheduler(optimizer, optim, trainer.max_steps)
    return model, optimizer, scheduler


def optimizer_sharding(comm: CommConfig) -> str:
    """``comm.shard_optimizer``: inside each node (our communicators), over the job (comm=ddp: torch's
    ZeroRedundancyOptimizer), or none."""
    if not comm.shard_optimizer:
        return "none"
    return "job" if comm.algorithm == "ddp" else "node"


def _check_resumable(state: dict[str, Any], model: Component, where: Path, kind: str) -> None:
    """The checkpoint must hold this model, written the way this run reads state (``kind``); any world size
    will do (see :mod:`hybrid.app.state.membership`)."""
    saved_model = state.get("model_config")
    if isinstance(saved_model, dict) and "_target_" in saved_model:  # written before a built-in model moved
        saved_model = {**saved_model, "_target_": current_target(saved_model["_target_"])}
    if saved_model != model.node:
        raise ValueError(f"trainer.resume={str(where)!r} holds model {saved_model}, this run has {model.node}")
    check_state_kind(state.get("state_dict_kind", PlainState.kind), kind, str(where))


def check_state_kind(saved: str, wanted: str, where: str) -> None:
    """A checkpoint written through torch's distributed state-dict API (comm=hsdp: optimizer state keyed by
    parameter name) loads only that way, and one of ``Module.state_dict`` (every other comm) only that way.
    ``wanted``: this run's kind, or its comm (hsdp or another)."""
    if wanted in COMM_ALGORITHMS:
        wanted = SHARDED_STATE_KIND if wanted == "hsdp" else PlainState.kind
    if saved != wanted:
        def by(kind: str) -> str:
            return "comm=hsdp" if kind == SHARDED_STATE_KIND else "a comm other than hsdp"
        raise ValueError(f"trainer.resume={where!r} was written by {by(saved)} ({saved} state dicts); this run "
                         f"needs {by(wanted)}'s: resume it with comm={'hsdp' if saved == SHARDED_STATE_KIND else 'ddp'} "
                         "or another comm of its kind")


def restore_training(trainer: TrainerConfig, model_config: Component, run_path: Path, rank: int, now: RunLayout,
                     metrics: Metrics, model: nn.Module, optimizer: Any, scheduler: Any,
                     streams: Sequence[BatchStream], residual_signature: dict[str, Any] | None = None,
                     access: StateAccess | None = None, held: HeldState | None = None,
                     ) -> tuple[int, dict[str, Any] | None, list[dict[str, Any]], dict[str, Any]]:
    """Load ``trainer.resume``'s checkpoint (or, after an elastic restart, this run's last one; after recovery
    in place, ``held``: a survivor's state from memory) into these objects; return the step to start at
    (0: a fresh run), this rank's error-feedback residuals where
    the checkpoint has them for a run of signature ``residual_signature`` (see :mod:`hybrid.app.state.error_feedback`;
    None: this run does not compress), the run's layout history, and the checkpoint's entries that a replica
    kind loads itself (comm=diloco's nodes: :data:`hybrid.app.replicas.diloco.CHECKPOINT_KEY`). The checkpoint may come from another
    layout (:mod:`hybrid.app.state.membership`). ``access``: how model and optimizer state load (default: their
    own ``load_state_dict``). Collective over the default group."""
    access = access or PlainState()
    history = start_history(now)
    state, saved_residuals, where, why = _state_to_continue(trainer, run_path, rank, metrics, held)
    if state is None:
        return 0, None, history, {}
    _check_resumable(state, model_config, where, access.kind)
    access.load(model, optimizer, state["model"], state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    start_step = int(state["step"])
    history, saved = history_after_resume(state, now, start_step, why)
    # An older checkpoint's position counts its layout's batches: workers x the per-worker batch.
    old_batch = saved.world_size * (now.global_batch // now.world_size // trainer.grad_accum_steps)
    notes = {stream.restore(state["data"], old_batch) for stream in streams}  # all at one (epoch, sample)
    for note in sorted(n for n in notes if n):
        metrics.status(note)
    if saved != now:
        lr = apply_lr_policy(trainer.elastic_lr, saved, now, optimizer, scheduler)
        metrics.status(describe_change(saved, now, lr))
    mine = error_feedback.restore_residuals(saved_residuals, residual_signature, metrics.status)
    extra = {key: state[key] for key in (DILOCO_KEY, ADAPTIVE_KEY, HELD_OUTER_KEY) if key in state}
    metrics.status(f"resumed from step {start_step} of {where}")
    return start_step, mine, history, extra


def _state_to_continue(trainer: TrainerConfig, run_path: Path, rank: int, metrics: Metrics,
                       held: HeldState | None) -> tuple[dict[str, Any] | None, Any, Any, str]:
    """The state a run continues from, on every rank (None: a fresh run), rank 0's error-feedback residuals
    of it, where it comes from, and why (the membership history's words). Collective."""
    if held is not None:
        return held.assemble(metrics.status), None, "the survivors' memory", held.why
    source = resume_target(trainer.resume, run_path)
    # After a restart by the elastic agent, continue from this run's last checkpoint if it wrote one. Any rank's
    # count says so: torch counts a restart only on a node whose workers failed, so a survivor whose agent
    # restarted them for the new round (its workers still healthy), or a node that joined late, starts with
    # count 0 where the others have theirs; rank 0 may be such a rank. Rank 0 owns the run dir and decides for all.
    # The same after Slurm requeued the job: it runs again in its own run dir (hybrid.runtime.slurm.slurm_restart).
    counts = all_gather_object((int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), slurm_restart()))
    elastic, requeue = max(c[0] for c in counts), max(c[1] for c in counts)
    mine = (elastic, requeue) if rank == 0 and (elastic or requeue) and checkpoint_steps(run_path / "checkpoints") \
        else (0, 0)
    elastic, requeue = broadcast_from_rank0(mine)
    why = f"elastic restart {elastic}" if elastic else f"Slurm requeue {requeue}" if requeue else ""
    if why:
        source = run_path
        metrics.status(f"{why}: resuming from the last checkpoint in {run_path / 'checkpoints'}")
    if source is None:
        return None, None, None, ""
    state = load_checkpoint(source, log=metrics.status) if rank == 0 else None
    # Every rank's residuals stay on rank 0 until each gets only its own.
    saved_residuals = state.pop(error_feedback.CHECKPOINT_KEY, None) if state is not None else None
    return broadcast_from_rank0(state), saved_residuals, source, why or f"resumed from {source}"


@dataclass
class Training:
    """What :func:`set_up` built: the leader model (on the first device) and its optimizer and schedule, one
    batch stream per replica, the step to start at, and this process's restored error-feedback residuals."""

    dataset: Dataset
    model: nn.Module
    loss_fn: LossFn
    optimizer: Any
    scheduler: Any
    streams: list[BatchStream]
    start_step: int
    residual_signature: dict[str, Any] | None
    residuals: dict[str, Any] | None
    layout: RunLayout
    membership: list[dict[str, Any]]  # the layout history, this run's last (see hybrid.app.state.membership)
    state: StateAccess  # how checkpoints read and load the model and optimizer
    resumed_extra: dict[str, Any]  # the checkpoint's entries a replica kind loads itself (see restore_training)
    progress: Progress = field(default_factory=Progress)  # the last completed step (the training loop keeps it)
    # Recovery in place: the step after which this session stops to take a joining node in (None: no node
    # waits), asked by the training loop at every step's end (hybrid.app.state.in_place).
    room_after: Callable[[], int | None] | None = None


def set_up(cfg: TrainConfig, stream_ranks: Sequence[int], world_size: int, node_sizes: Sequence[int],
           device: torch.device, run_path: Path, metrics: Metrics, process_rank: int,
           state: StateAccess | None = None, held: HeldState | None = None) -> Training:
    """Build a run's training state for the replicas of global ranks ``stream_ranks`` (one in process mode,
    a node's in thread mode), restoring a checkpoint where the run resumes. Collective over the default
    group (``process_rank`` is this process's rank there). ``state``: how the model is prepared and its
    state read and loaded (default :class:`~hybrid.app.replicas.base.PlainState`; comm=hsdp shards). ``held``:
    the state recovery in place continues from (:mod:`hybrid.app.state.in_memory`)."""
    state = state or PlainState()
    dataset = load_dataset(cfg.data)
    model, optimizer, scheduler = build_training(cfg.model, cfg.optim, cfg.trainer, device, state,
                                                 optimizer_sharding(cfg.comm))
    # The run's first line (rank 0's metrics print it): the first point where the gradients' size is known.
    metrics.status(describe_run(node_sizes, cfg.comm.algorithm, cfg.model.label, cfg.model.args, param_bytes(model),
                                run_path, thread_mode=cfg.cluster.intra_mode == "thread"))
    loss_fn = build_loss(cfg.loss)
    streams = [BatchStream(dataset, cfg.data.batch_size, rank, world_size, cfg.trainer.seed,
                           pin_memory=device.type == "cuda", num_workers=cfg.data.num_workers)
               for rank in stream_ranks]
    signature = error_feedback.signature(cfg.comm, cfg.cluster.intra_mode, node_sizes)
    now = RunLayout(len(node_sizes), world_size, world_size * cfg.data.batch_size * cfg.trainer.grad_accum_steps)
    start_step, residuals, history, extra = restore_training(cfg.trainer, cfg.model, run_path, process_rank, now, metrics,
                                                      model, optimizer, scheduler, streams, signature, state,
                                                             held)
    return Training(dataset, model, loss_fn, optimizer, scheduler, streams, start_step, signature, residuals, now,
                    history, state, extra, Progress(start_step, streams[0].state()))
