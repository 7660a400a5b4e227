"""The training loop: one step function, the loop around it, and the checkpoints it writes.

Process and thread mode share all of it; they differ only in the
:class:`~hybrid.app.replicas.base.Replicas` they hand in. Gradients are averaged
(identical on every rank) before the step, so every decision here, such as
skipping a step with non-finite gradients, is taken alike on every rank
without talking.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.app.components.data import BatchStream
from hybrid.app.components.models import param_bytes
from hybrid.app.config import ADAPTIVE, DILOCO, TrainConfig, TrainerConfig
from hybrid.app.observability.link_watch import LinkWatch
from hybrid.app.observability.metrics import Metrics
from hybrid.app.observability.run_metrics import MetricsProcessor
from hybrid.app.replicas.base import Replicas, StateAccess, check_replicas, grads_finite
from hybrid.app.setup import Training
from hybrid.app.state import error_feedback
from hybrid.app.state.checkpoint import save_checkpoint
from hybrid.app.state.in_memory import Progress, checkpoint_meta
from hybrid.app.state.membership import RunLayout
from hybrid.app.state.preemption import Preempted, SignalStop, mark_stopped
from hybrid.core.adaptive import Mode
from hybrid.core.comm import Communicator, PhaseCounters
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer, optimizer_state_bytes
from hybrid.core.topology import Topology
from hybrid.runtime.link_schedule import LinkChange, StepChanges
from hybrid.runtime.quorum import MakeRoom

__all__ = ["Checkpointer", "train_and_report", "train_loop", "train_step"]

LINK_TIMEOUT_S = 60.0  # how long rank 0 waits for the launcher to reshape the testbed's links


def train_step(replicas: Replicas, optimizer: torch.optim.Optimizer, scheduler: Any, trainer: TrainerConfig,
               grads_as_bucket_views: bool, step: int, processor: MetricsProcessor) -> torch.Tensor:
    """Forward, backward (gradients averaged over all ranks), optimizer and schedule step; returns the loss.

    Averaged gradients are clipped where ``trainer.grad_clip_norm`` asks; non-finite ones skip the step or
    stop the run (``trainer.nonfinite_grads``)."""
    total_loss = replicas.forward_backward(trainer.grad_accum_steps)
    # comm.shard_optimizer: each worker holds its shard of the averaged gradients only; the norm comes from them.
    sharded = isinstance(optimizer, NodeShardedOptimizer)
    with processor.recorder.span("optimizer"):
        if optimizer.grads_finite() if sharded else grads_finite(replicas.module):
            if trainer.grad_clip_norm and sharded:
                processor.grad_norm = optimizer.clip_grad_norm_(trainer.grad_clip_norm)
            elif trainer.grad_clip_norm:
                # The averaged gradients are the same bits on every rank, so every rank clips them alike.
                processor.grad_norm = torch.nn.utils.clip_grad_norm_(replicas.module.parameters(),
                                                                     trainer.grad_clip_norm)
            optimizer.step()
        elif trainer.nonfinite_grads == "skip":
            processor.step_skipped(step + 1)
        else:
            raise FloatingPointError(
                f"step {step + 1}: non-finite (inf/NaN) gradients after averaging over all ranks; stopping "
                "(trainer.nonfinite_grads=skip would skip such steps)"
            )
        scheduler.step()
        # With gradients as bucket views, zeroing in place keeps them views: backward then accumulates straight
        # into DDP's buckets. Setting them to None would make autograd allocate fresh gradients each step and DDP
        # copy them into the buckets again (its own no-hook path fuses the averaging into that copy; a comm hook
        # cannot, so it would pay one more pass over the gradients than DDP). Every comm, ddp included, zeroes
        # the same way, so a parameter unused in a step gets the same update under each.
        optimizer.zero_grad(set_to_none=not grads_as_bucket_views)
    replicas.end_step()
    return total_loss


class Checkpointer:
    """Writes the run's checkpoints (rank 0), with every rank's error-feedback residuals gathered to it."""

    def __init__(self, run_path: Path, cfg: TrainConfig, layout: RunLayout, membership: list[dict[str, Any]],
                 rank: int, feedback: error_feedback.ErrorFeedback | None, state: StateAccess) -> None:
        self.directory, self.keep = run_path / "checkpoints", cfg.trainer.keep_checkpoints
        self.meta = checkpoint_meta(cfg.model.node, layout.world_size, layout.nnodes, layout.global_batch, state.kind,
                                    cfg.optim.no_decay)
        self.membership, self.rank, self.feedback, self.state = membership, rank, feedback, state

    def save(self, step: int, replicas: Replicas, optimizer: Any, scheduler: Any, stream: BatchStream) -> None:
        """Collective (the residuals' gather, a sharded model's state); only rank 0 writes."""
        residuals = self.feedback.gather() if self.feedback is not None else None
        deferred = None
        if isinstance(optimizer, NodeShardedOptimizer) and not getattr(self.state, "in_diloco", False):
            # Its whole state is gathered bucket by bucket into the file: rank 0 never holds all of it. (DiLoCo's
            # nodes each hold their own: its state streams every node's, gathered on the node's leader.)
            optimizer_state, deferred = optimizer.deferred_state_dict()
            model_state = replicas.module.state_dict()
        else:
            model_state, optimizer_state = self.state.collect(replicas.module, optimizer)
            deferred = self.state.deferred()  # comm=diloco: the other nodes' states, streamed as rank 0 writes
        extra = self.state.extra()
        if self.rank != 0:
            if deferred is not None:
                deferred.fill(None)  # rank 0's node: each worker sends its slices as rank 0 writes
            return
        if self.feedback is not None and residuals is None:  # the writer must be the default group's rank 0
            raise RuntimeError(f"rank {self.rank} writes checkpoints but is rank {dist.get_rank()} of the "
                               "default group, where the error-feedback residuals were gathered")
        if residuals is not None:
            extra[error_feedback.CHECKPOINT_KEY] = residuals
        save_checkpoint(self.directory, {
            "model": model_state, "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(), "step": step, "data": stream.state(),
            "rng": torch.get_rng_state(), "membership": self.membership, **self.meta, **extra,
        }, step, keep=self.keep, meta=self.meta, deferred=deferred)


def train_loop(trainer: TrainerConfig, replicas: Replicas, optimizer: torch.optim.Optimizer, scheduler: Any,
               stream: BatchStream, processor: MetricsProcessor, checkpointer: Checkpointer, start_step: int,
               grads_as_bucket_views: bool, device: torch.device, progress: Progress | None = None,
               stop: SignalStop | None = None, room_after: Callable[[], int | None] | None = None,
               before_step: Callable[[int], None] | None = None) -> int:
    """Steps ``start_step`` .. the last one (``max_steps``, or ``stop_after`` steps on); checks replicas and
    writes checkpoints on schedule and at the end. Returns the last step. ``progress``: kept up to date after
    every step. ``stop``: Slurm's warning before the end; raises :class:`Preempted` after the agreed step's
    checkpoint. ``room_after``: recovery in place's step to stop after for a joining node (every worker the
    same); raises :class:`MakeRoom` there, between steps, where no collective is in flight. ``before_step``:
    called with the steps done ahead of each step, on every rank (the testbed's link schedule)."""
    last = trainer.max_steps if not trainer.stop_after else min(trainer.max_steps, start_step + trainer.stop_after)
    recorder = processor.recorder
    progress = progress if progress is not None else Progress()
    progress.step, progress.data = start_step, stream.state()
    progress.optimizer_updates = getattr(optimizer, "updates", 0)
    for step in range(start_step, last):
        done = step + 1
        if before_step is not None:
            before_step(step)
        processor.step_begin(done)
        started = time.perf_counter()
        loss = train_step(replicas, optimizer, scheduler, trainer, grads_as_bucket_views, step, processor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # honest step time; this is a local wait, not a collective
        progress.step, progress.data, progress.step_s = done, stream.state(), time.perf_counter() - started
        progress.optimizer_updates = getattr(optimizer, "updates", 0)
        processor.step_done(done, loss, progress.step_s, scheduler.get_last_lr()[0], last)
        if trainer.check_replicas_every and done % trainer.check_replicas_every == 0:
            with recorder.span("check_replicas"):
                check_replicas(replicas.local_models(), done, replicas.shard_index)
        if trainer.checkpoint_every and done % trainer.checkpoint_every == 0 and done < last:
            with recorder.span("checkpoint"):
                checkpointer.save(done, replicas, optimizer, scheduler, stream)
        processor.step_end(done)
        if room_after is not None and (agreed := room_after()) is not None and done >= agreed and done < last:
            raise MakeRoom(done)
        if stop is not None and (agreed := stop.stop_after(done)) is not None and done >= agreed and done < last:
            if not (trainer.checkpoint_every and done % trainer.checkpoint_every == 0):  # not saved just above
                with recorder.span("checkpoint"):
                    checkpointer.save(done, replicas, optimizer, scheduler, stream)
            if checkpointer.rank == 0:
                mark_stopped(checkpointer.directory.parent, done)
            raise Preempted(done)
    checkpointer.save(last, replicas, optimizer, scheduler, stream)
    return last


def train_and_report(cfg: TrainConfig, run: Training, replicas: Replicas, topology: Topology, metrics: Metrics,
                     counters: PhaseCounters, run_path: Path, rank: int, device: torch.device,
                     feedback: error_feedback.ErrorFeedback | None, comm: Communicator | None = None,
                     ) -> dict[str, Any] | None:
    """What both modes do once their replicas are built: train from ``run.start_step`` with checkpoints and
    logging, then gather the run's result (rank 0 returns it and writes metrics.json; the others None)."""
    processor = MetricsProcessor(cfg, topology, metrics, counters, comm, run.membership, run_path)
    links = _link_changes(cfg, run_path, rank, metrics)
    processor.link_watch = getattr(replicas, "watch", None)  # comm=adaptive's, which it follows
    processor.compressors = getattr(replicas, "compressors", processor.compressors)  # and its 16-bit modes'
    if cfg.comm.adapt_every and processor.link_watch is None:
        current = Mode(cfg.comm.algorithm, "none" if cfg.comm.inter_compression == "none" else "bf16")
        processor.link_watch = LinkWatch(cfg.comm.adapt_every, topology.layout, param_bytes(replicas.module),
                                         current, metrics, cfg.cluster.testbed.nics_in_use, slack=cfg.comm.adapt_slack)
    checkpointer = Checkpointer(run_path, cfg, run.layout, run.membership, rank, feedback, run.state)
    try:
        last = train_loop(cfg.trainer, replicas, run.optimizer, run.scheduler, run.streams[0], processor, checkpointer,
                          run.start_step, cfg.comm.grad_as_bucket_view, device, run.progress,
                          # DiLoCo's nodes meet only every sync_every steps: they may be further apart than the
                          # agreement's margin, so such a job resumes from its last periodic checkpoint instead.
                          SignalStop.for_slurm() if cfg.comm.algorithm not in (DILOCO, ADAPTIVE) else None, run.room_after,
                          links.before if links is not None else None)
    except Preempted as stopped:  # not the run's end: the requeued job continues from the checkpoint
        metrics.status(str(stopped))
        return {"preempted_after": stopped.step} if rank == 0 else None
    summary = getattr(replicas, "summary", None)  # what a replica kind adds to metrics.json (comm=diloco's)
    extra = summary() if summary is not None else {}
    if isinstance(run.optimizer, NodeShardedOptimizer):  # 0: the shard followed DDP's settled buckets throughout
        extra["optimizer_relayouts"] = run.optimizer.relayouts
    if links is not None:
        extra["link_changes"] = links.applied
    if processor.link_watch is not None:
        extra["link_watch"] = processor.link_watch.history
    return processor.finish(replicas.local_models(), replicas.module, last, device, run_path, rank,
                            replicas.shard_index, extra, optimizer_state_bytes(run.optimizer))


class _LoggedStepChanges(StepChanges):
    """A schedule in steps, with each change in TensorBoard (``testbed/link_mbit``: the slowest node's rate)."""

    def __init__(self, metrics: Metrics, *args: Any) -> None:
        super().__init__(*args)
        self.metrics = metrics

    def before(self, done: int) -> LinkChange | None:
        change = super().before(done)
        if change is not None and self.rank == 0:
            self.metrics.scalars(done + 1, {"testbed/link_mbit": min(change.mbit)})
        return change


def _link_changes(cfg: TrainConfig, run_path: Path, rank: int, metrics: Metrics) -> StepChanges | None:
    """The workers' side of ``cluster.testbed.link_schedule`` in steps (the launcher applies one in seconds)."""
    schedule = cfg.cluster.testbed.schedule(cfg.cluster.nnodes) if cfg.cluster.testbed.enabled else None
    if schedule is None or schedule.unit != "step":
        return None
    launched = cfg.cluster.testbed.rates(cfg.cluster.nnodes)
    return _LoggedStepChanges(metrics, schedule, launched, run_path, rank, _barrier, LINK_TIMEOUT_S)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
