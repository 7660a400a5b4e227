"""The per-rank training loop: data -> device, forward, loss, backward (gradient sync), step.

:func:`run_worker` runs on every rank, under torchrun or :mod:`hybrid.launch`.
Each worker computes on its own mini-batches; the only collectives during
training are the gradient all-reduces of the chosen ``comm`` (plain DDP's, or
the hybrid communicator's through the DDP comm hook). Start-up (topology,
resume) and the end of the run (parameter checksums) exchange a little over
the default group; nothing else synchronises.

With ``cluster.intra_mode=thread`` a worker is a whole node driving its
devices' replicas (:mod:`hybrid.node_parallel`); :func:`_loop` steps either
through the small :class:`Replicas` interface.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid import error_feedback
from hybrid.checkpoint import checkpoint_steps, load_checkpoint, save_checkpoint
from hybrid.comm import (MODEL_LEVELS, PHASES, AutoCommunicator, CommGroups, Communicator, PhaseCounters,
                         group_kinds_for, make_communicator, register_comm_hook, settle_buckets)
from hybrid.config import TrainConfig, resume_target
from hybrid.data import KIND_OF_MODEL, ArrayDataset, BatchStream, DatasetSpec, check_arrays, ensure_synthetic, load_arrays
from hybrid.distributed import broadcast_from_rank0, init_distributed, shutdown_distributed
from hybrid.metrics import Metrics, NullMetrics, TensorBoardMetrics, write_json_atomic
from hybrid.models import build_model, param_bytes
from hybrid.optim import build_optimizer, build_scheduler
from hybrid.topology import Topology, discover_topology

__all__ = ["RankReplica", "ReplicaDivergence", "Replicas", "build_training", "check_replicas", "grads_finite",
           "load_dataset", "param_checksum", "restore_training", "run_worker", "train_on_rank"]


# Our models' buffers are constants (e.g. the causal mask): syncing them every
# forward would be a second, needless collective per step.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else {"broadcast_buffers": False}
)


def param_checksum(model: nn.Module) -> str:
    """sha256 over the exact bits of every parameter: equal strings mean bit-identical replicas."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def grads_finite(model: nn.Module) -> bool:
    """True if no gradient holds inf or NaN (one reduction per tensor, one sync)."""
    sums = [p.grad.sum() for p in model.parameters() if p.grad is not None]
    return not sums or bool(torch.stack(sums).isfinite().all())


class ReplicaDivergence(RuntimeError):
    """Ranks that should hold identical parameters do not."""


def check_replicas(model: nn.Module | Sequence[nn.Module], step: int) -> None:
    """Compare parameter checksums across ranks; raise on every rank, naming the ranks that differ.

    ``model`` may be this process's replicas in global rank order (intra_mode=thread: a node's
    replicas, one process per node): ranks are then numbered across all of them."""
    mine = [param_checksum(m) for m in ([model] if isinstance(model, nn.Module) else model)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    every = [digest for digests in gathered for digest in digests]
    groups: dict[str, list[int]] = {}
    for r, digest in enumerate(every):
        groups.setdefault(digest, []).append(r)
    if len(groups) > 1:
        majority = max(groups.values(), key=len)
        diverged = sorted(r for ranks in groups.values() if ranks is not majority for r in ranks)
        raise ReplicaDivergence(
            f"step {step}: replicas diverged: rank(s) {diverged} hold parameters different from "
            f"rank(s) {majority}; stopping (trainer.check_replicas_every)"
        )


def _device(cfg: TrainConfig, local_rank: int) -> torch.device:
    want = cfg.trainer.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def load_dataset(cfg: TrainConfig) -> ArrayDataset:
    """The dataset of ``cfg`` (generating synthetic data on first use), checked against the model."""
    d = cfg.data
    if d.name == "synthetic":
        spec = DatasetSpec(KIND_OF_MODEL[cfg.model.name], d.num_samples, d.features, d.classes,
                           d.image_size, d.vocab_size, d.seq_len, d.seed)
        inputs, targets = ensure_synthetic(Path(d.root), spec)
        x, y = load_arrays(inputs, targets)
        where = f"synthetic data {inputs.parent}"
    else:
        x, y = load_arrays(d.inputs, d.targets or None)
        where = f"data.inputs={d.inputs!r}"
    check_arrays(x, y, cfg.model.name, d.classes, d.vocab_size, where)
    return ArrayDataset(x, y)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sample_batch(dataset: ArrayDataset, batch_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's first ``batch_size`` rows: a batch of the right shapes that consumes no stream."""
    rows = [dataset[i] for i in range(min(batch_size, len(dataset)))]
    return torch.stack([x for x, _ in rows]).to(device), torch.stack([y for _, y in rows]).to(device)


def _check_resumable(state: dict[str, Any], cfg: TrainConfig, world: int, where: Path) -> None:
    saved_model, saved_world = state.get("model_config"), state.get("world_size")
    if saved_model != asdict(cfg.model):
        raise ValueError(f"trainer.resume={str(where)!r} holds model {saved_model}, this run has {asdict(cfg.model)}")
    if saved_world != world:
        raise ValueError(f"trainer.resume={str(where)!r} was written by world size {saved_world}, this run has {world}")


def build_training(cfg: TrainConfig, dataset: ArrayDataset, device: torch.device) -> tuple[nn.Module, Any, Any]:
    """Model, optimizer and LR schedule; the same initial weights in every process (the seed)."""
    torch.manual_seed(cfg.trainer.seed)  # same initial weights on every rank
    sample_shape = tuple(dataset[0][0].shape)
    model = build_model(cfg.model.name, width=cfg.model.width, depth=cfg.model.depth,
                        channels=cfg.model.channels, heads=cfg.model.heads, input_shape=sample_shape,
                        classes=cfg.data.classes, vocab_size=cfg.data.vocab_size, seq_len=cfg.data.seq_len).to(device)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.trainer.max_steps)
    return model, optimizer, scheduler


def restore_training(cfg: TrainConfig, run_path: Path, rank: int, world_size: int, metrics: Metrics,
                     model: nn.Module, optimizer: Any, scheduler: Any, streams: Sequence[BatchStream],
                     residual_signature: dict[str, Any] | None = None) -> tuple[int, dict[str, Any] | None]:
    """Load ``trainer.resume``'s checkpoint (or, after an elastic restart, this run's last one) into these
    objects; return the step to start at (0: a fresh run) and this rank's error-feedback residuals where
    the checkpoint has them for a run of signature ``residual_signature`` (see :mod:`hybrid.error_feedback`;
    None: this run does not compress). Collective over the default group."""
    start_step, mine = 0, None
    source = resume_target(cfg.trainer.resume, run_path)
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
        _check_resumable(state, cfg, world_size, source)
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


class Replicas(Protocol):
    """What :func:`_loop` steps: this rank's DDP model (:class:`RankReplica`), or a node's replicas driven by
    one process (``cluster.intra_mode=thread``, :class:`hybrid.node_parallel.NodeReplicas`)."""

    module: nn.Module  # the parameters the optimizer steps, checkpoints and checksums see

    def forward_backward(self, accum: int) -> torch.Tensor:
        """Every micro-step of one step, leaving gradients averaged over all ranks in ``module``;
        returns this (leading) rank's loss, summed over the micro-steps."""

    def end_step(self) -> None:
        """After the optimizer step (taken or skipped) and zero_grad."""

    def local_models(self) -> list[nn.Module]:
        """The replicas this process holds, in global rank order."""


class RankReplica:
    """Process mode: one replica per process, this rank's model under DDP."""

    def __init__(self, ddp: DDP, stream: BatchStream, device: torch.device) -> None:
        self.ddp, self.stream, self.device = ddp, stream, device

    @property
    def module(self) -> nn.Module:
        return self.ddp.module

    def forward_backward(self, accum: int) -> torch.Tensor:
        total_loss = torch.zeros((), device=self.device)
        for micro in range(accum):
            x, y = next(self.stream)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            # Only the last micro-step synchronises gradients.
            with self.ddp.no_sync() if micro < accum - 1 else nullcontext():
                loss = _loss(self.ddp, x, y) / accum
                loss.backward()
            total_loss += loss.detach()
        return total_loss

    def end_step(self) -> None:
        pass  # every rank stepped its own replica with the same averaged gradients

    def local_models(self) -> list[nn.Module]:
        return [self.ddp.module]


def run_worker(cfg: TrainConfig, run_dir: str | None) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns the final metrics (also written to metrics.json)."""
    env = init_distributed(cfg.comm.timeout_s)
    metrics: Metrics = NullMetrics()
    failed = False
    try:
        # Under torchrun every rank has its own Hydra dir: rank 0's is the run's.
        run_path = Path(broadcast_from_rank0(run_dir))
        topology = discover_topology(env)
        device = _device(cfg, env.local_rank)
        threads = cfg.trainer.num_threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(
            1, (os.cpu_count() or 1) // topology.local_world_size
        )
        torch.set_num_threads(threads)
        if env.rank == 0:
            metrics = TensorBoardMetrics(run_path / "tb")
        return train_on_rank(cfg, topology, device, run_path, metrics, env.rank)
    except Exception as exc:
        # Said at once: the agent reports the first worker it sees exit, and a peer that finds this rank's
        # connections closed can exit before this one has recorded its error.
        print(f"rank {env.rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        failed = True
        raise
    finally:
        metrics.close()
        if not failed:
            # On failure the sockets close when this process exits, after torchelastic has recorded its
            # error, so peers that then fail on the closed connection come second.
            shutdown_distributed()


def train_on_rank(cfg: TrainConfig, topology: Topology, device: torch.device, run_path: Path,
           metrics: Metrics, rank: int) -> dict[str, Any] | None:
    if cfg.cluster.intra_mode == "thread":
        # This process is a whole node driving its devices' replicas (nn.DataParallel-style); same loop below.
        from hybrid.node_parallel import train_node

        return train_node(cfg, topology, device, run_path, metrics)
    dataset = load_dataset(cfg)
    model, optimizer, scheduler = build_training(cfg, dataset, device)
    stream = BatchStream(dataset, cfg.data.batch_size, topology.rank, topology.world_size, cfg.trainer.seed,
                         pin_memory=device.type == "cuda", num_workers=cfg.data.num_workers)
    residual_signature = error_feedback.signature(cfg, topology.node_sizes)
    start_step, residuals = restore_training(cfg, run_path, rank, topology.world_size, metrics, model, optimizer,
                                             scheduler, [stream], residual_signature)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=cfg.comm.grad_as_bucket_view,
              **_NO_BUFFER_SYNC)
    counters = PhaseCounters()
    hook = groups = comm = None
    finished = False
    try:
        if cfg.comm.algorithm != "ddp":
            groups = CommGroups.build(topology, cfg.comm.intra_backend, cfg.comm.inter_backend, cfg.comm.timeout_s,
                                      kinds=group_kinds_for(cfg.comm.algorithm, topology))
            comm = make_communicator(cfg.comm.algorithm, groups, counters, cfg.comm.chunk_bytes,
                                     cfg.comm.inter_compression, device=device)
            if isinstance(comm, AutoCommunicator):
                metrics.status(describe_auto_calibration(comm))
            hook = register_comm_hook(ddp, comm)
        feedback = error_feedback.ErrorFeedback.attach(residual_signature, comm, residuals, device)
        # The first real step already sees DDP's rebuilt buckets, as every later one does: a resumed run
        # then sums each element in the order the uninterrupted run did, and residuals keyed by bucket apply.
        x, y = _sample_batch(dataset, cfg.data.batch_size, device)
        settle_buckets(ddp, hook, lambda: _loss(ddp, x, y).backward())
        result = _loop(cfg, RankReplica(ddp, stream, device), optimizer, scheduler, stream, counters, metrics,
                       run_path, topology, device, start_step, rank, comm, feedback)
        finished = True
        return result
    finally:
        if hook is not None:
            hook.close()
        if groups is not None and finished:
            # On failure the groups' sockets close when this process exits, after its error is recorded
            # (see run_worker): peers that fail on them then come second.
            groups.destroy()


def describe_auto_calibration(comm: AutoCommunicator) -> str:
    """One status line: what auto measured at start-up (or that it had nothing to choose from)."""
    if comm.model is None:
        return f"comm=auto: only {comm.candidates[0]} applies to this layout; no calibration"

    def level(lv: Any) -> str:
        rate = "bandwidth unresolved" if lv.gbit_per_s is None else f"{lv.gbit_per_s:.3g} Gbit/s"
        return f"alpha {lv.alpha_s * 1e6:.0f} us, {rate}"

    levels = "; ".join(f"{name} {level(lv)}" for name in MODEL_LEVELS if (lv := getattr(comm.model, name)) is not None)
    # Without a measured cross level, sharded is priced by spreading the inter level over the NICs.
    nics = "" if comm.model.sharded_inter is not None else f"; {comm.model.nics_per_node} NIC(s) per node for sharded"
    return (f"comm=auto calibrated in {comm.calibration_s:.2f} s: {levels}{nics}; choosing among "
            f"{', '.join(comm.candidates)} per bucket size")


def _bucket_kind(d: dict[str, Any]) -> str:
    """A decision's bucket: its bytes, and its dtype where that is not fp32 (auto decides per both)."""
    return f"{d['bytes']}B" + ("" if d["dtype"] == "float32" else f"_{d['dtype']}")


def log_auto_decisions(comm: AutoCommunicator, metrics: Metrics, step: int, logged: set[str]) -> None:
    """Send decisions not yet in ``logged`` (bucket kinds: bytes, and dtype where not fp32) to TensorBoard:
    predicted ms per candidate as scalars, and one text table of every decision so far."""
    report = comm.report()["decisions"]
    new = [d for d in report if _bucket_kind(d) not in logged]
    if not new:
        return
    for d in new:
        logged.add(_bucket_kind(d))
        tag = f"comm_auto/{_bucket_kind(d)}"
        metrics.scalars(step, {f"{tag}/predicted_{alg}_ms": s * 1e3 for alg, s in d["predicted_s"].items()})
        metrics.status(f"comm=auto: {d['bytes'] / 2**20:.2f} MiB {d['dtype']} buckets -> {d['chosen']} (predicted "
                       + ", ".join(f"{a} {s * 1e3:.1f} ms" for a, s in d["predicted_s"].items()) + ")")
    rows = [f"| {d['bytes']} | {d['dtype']} | {d['chosen']} | " + " | ".join(
        f"{d['predicted_s'][a] * 1e3:.2f}" if a in d["predicted_s"] else "-" for a in comm.candidates) + " |"
        for d in report]
    table = "\n".join([f"| bucket bytes | dtype | chosen | {' | '.join(f'{a} ms' for a in comm.candidates)} |",
                       "|" + " --- |" * (3 + len(comm.candidates)), *rows])
    metrics.text("comm_auto/decisions", table, step)


def _runs_as(comm: Communicator | None, cfg: TrainConfig) -> str:
    """What actually ran: the algorithm (after any fallback), or auto's choices by bucket size."""
    if comm is None:
        return cfg.comm.algorithm
    if isinstance(comm, AutoCommunicator):
        return ",".join(f"{d['bytes']}{'' if d['dtype'] == 'float32' else '_' + d['dtype']}:{d['chosen']}"
                        for d in comm.report()["decisions"]) or "auto"
    return comm.name


def _loop(cfg: TrainConfig, replicas: Replicas, optimizer: torch.optim.Optimizer, scheduler: Any, stream: BatchStream,
          counters: PhaseCounters, metrics: Metrics, run_path: Path, topology: Topology,
          device: torch.device, start_step: int, rank: int, comm: Communicator | None = None,
          feedback: error_feedback.ErrorFeedback | None = None) -> dict[str, Any] | None:
    t = cfg.trainer
    accum = t.grad_accum_steps
    samples_per_step = cfg.data.batch_size * accum * topology.world_size
    totals = {p: [0.0, 0] for p in PHASES}
    step_times: list[float] = []
    skipped = 0
    loss_value = float("nan")
    interval_start, interval_steps = time.perf_counter(), 0
    auto_logged: set[str] = set()

    def checkpoint(step: int) -> None:
        # Every rank's error-feedback residuals go to rank 0, the one that writes (a collective).
        residuals = feedback.gather() if feedback is not None else None
        if rank == 0:
            if feedback is not None and residuals is None:  # the writer must be the default group's rank 0
                raise RuntimeError(f"rank {rank} writes checkpoints but is rank {dist.get_rank()} of the "
                                   "default group, where the error-feedback residuals were gathered")
            meta = {"model_config": asdict(cfg.model), "world_size": topology.world_size}
            extra = {error_feedback.CHECKPOINT_KEY: residuals} if residuals is not None else {}
            save_checkpoint(run_path / "checkpoints", {
                "model": replicas.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "step": step, "data": stream.state(),
                "rng": torch.get_rng_state(), **meta, **extra,
            }, step, keep=t.keep_checkpoints, meta=meta)

    last = t.max_steps if not t.stop_after else min(t.max_steps, start_step + t.stop_after)
    for step in range(start_step, last):
        started = time.perf_counter()
        total_loss = replicas.forward_backward(accum)
        # Gradients are averaged, so identical on every rank: every rank decides alike, no collective.
        if grads_finite(replicas.module):
            optimizer.step()
        elif t.nonfinite_grads == "skip":
            skipped += 1
            metrics.status(f"step {step + 1}: non-finite gradients, step skipped ({skipped} so far)")
        else:
            raise FloatingPointError(
                f"step {step + 1}: non-finite (inf/NaN) gradients after averaging over all ranks; stopping "
                "(trainer.nonfinite_grads=skip would skip such steps)"
            )
        scheduler.step()
        # With gradients as bucket views, zeroing in place keeps them views: backward then
        # accumulates straight into DDP's buckets. Setting them to None would make autograd
        # allocate fresh gradients each step and DDP copy them into the buckets again (its own
        # no-hook path fuses the averaging into that copy; a comm hook cannot, so it would pay
        # one more pass over the gradients than DDP). Every parameter of our models gets a
        # gradient every step, so zeros and None give the same update.
        optimizer.zero_grad(set_to_none=not cfg.comm.grad_as_bucket_view)
        replicas.end_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # honest step time; this is a local wait, not a collective
        step_times.append(time.perf_counter() - started)
        interval_steps += 1
        phases = counters.snapshot(reset=True)
        for name, stats in phases.items():
            totals[name][0] += stats.seconds
            totals[name][1] += stats.bytes
        done = step + 1
        if done % t.log_every == 0 or done == last:
            loss_value = float(total_loss)
            elapsed = time.perf_counter() - interval_start
            rate = samples_per_step * interval_steps / elapsed
            values = {"train/loss": loss_value, "train/lr": scheduler.get_last_lr()[0],
                      "train/samples_per_s": rate, "train/step_time_s": step_times[-1]}
            for name, stats in phases.items():
                values[f"comm/{name}_s"] = stats.seconds
                values[f"comm/{name}_bytes"] = float(stats.bytes)
            metrics.scalars(done, values)
            if isinstance(comm, AutoCommunicator):
                log_auto_decisions(comm, metrics, done, auto_logged)
            metrics.status(f"step {done}/{t.max_steps}  loss {loss_value:.4f}  lr {values['train/lr']:.4g}  "
                           f"{rate:.0f} samples/s  {step_times[-1] * 1e3:.1f} ms/step")
            interval_start, interval_steps = time.perf_counter(), 0
        if t.check_replicas_every and done % t.check_replicas_every == 0:
            check_replicas(replicas.local_models(), done)
        if t.checkpoint_every and done % t.checkpoint_every == 0 and done < last:
            checkpoint(done)
    checkpoint(last)

    checksums = [param_checksum(m) for m in replicas.local_models()]
    checksum = checksums[0]
    # Linux reports the peak resident set in KiB: the high-water mark of this worker process.
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gathered: list[Any] = [None] * dist.get_world_size()  # processes: one per rank, or per node (thread mode)
    dist.all_gather_object(gathered, (checksums, peak_rss_mb))
    if rank != 0:
        return None
    all_checksums = [c for g in gathered for c in g[0]]
    timed = step_times[1:] or step_times  # the first step includes warm-up
    mean_step = sum(timed) / len(timed) if timed else float("nan")
    median_step = statistics.median(timed) if timed else float("nan")
    result = {
        "comm": cfg.comm.algorithm, "inter_compression": cfg.comm.inter_compression, "nnodes": topology.nnodes,
        "nproc_per_node": topology.node_sizes[0] if topology.is_uniform else list(topology.node_sizes),
        "world_size": topology.world_size, "steps": last, "steps_run": len(step_times),
        "final_loss": loss_value, "samples_per_s": samples_per_step / mean_step if timed else float("nan"),
        "mean_step_s": mean_step, "median_step_s": median_step, "samples_per_step": samples_per_step,
        "peak_rss_mb": [g[1] for g in gathered], "skipped_steps": skipped, "comm_s": {k: v[0] for k, v in totals.items()},
        "bytes": {k: v[1] for k, v in totals.items()}, "param_checksum": checksum,
        "param_checksums_identical": len(set(all_checksums)) == 1, "param_bytes": param_bytes(replicas.module),
        "intra_mode": cfg.cluster.intra_mode,
        "model": cfg.model.name, "bucket_mb": cfg.comm.bucket_mb, "batch_size": cfg.data.batch_size,
        "device": str(device), "run_dir": str(run_path), "runs_as": _runs_as(comm, cfg),
    }
    if isinstance(comm, AutoCommunicator):
        result["comm_auto"] = comm.report()
    metrics.hparams(
        {"nnodes": result["nnodes"], "nproc_per_node": str(result["nproc_per_node"]),
         "world_size": result["world_size"], "comm": result["comm"], "intra_mode": cfg.cluster.intra_mode,
         "bucket_mb": cfg.comm.bucket_mb,
         "inter_compression": cfg.comm.inter_compression, "runs_as": result["runs_as"],
         "model": cfg.model.name, "width": cfg.model.width, "depth": cfg.model.depth,
         "param_bytes": result["param_bytes"], "batch_size": cfg.data.batch_size,
         "optimizer": cfg.optim.name, "lr": cfg.optim.lr},
        {"final_loss": loss_value, "samples_per_s": result["samples_per_s"], "mean_step_s": mean_step,
         "comm_s": sum(v[0] for v in totals.values())},
    )
    write_json_atomic(run_path / "metrics.json", result)
    return result
