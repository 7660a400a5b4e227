"""The metrics processor: what a run logs while it trains and the ``metrics.json`` / HParams it ends with.

The loop hands it each finished step (loss, seconds, learning rate) and the
communicator's phase counters; it keeps the totals, sends scalars and status
lines every ``trainer.log_every`` steps (rank 0's writer; a null one
elsewhere), and at the end gathers every process's parameter checksums and
peak memory into one result, written atomically to ``metrics.json`` and
logged as HParams with the same keys in every run of a sweep.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from hybrid.app.components.models import param_bytes
from hybrid.app.config import TrainConfig
from hybrid.app.observability.link_watch import LinkWatch
from hybrid.app.observability.metrics import TAIL_STEPS, Metrics, hparam_value, write_json_atomic
from hybrid.app.observability.step_accounts import StepAccounts
from hybrid.app.observability.timeline_file import TimelineFile
from hybrid.app.replicas.base import param_checksum
from hybrid.core.comm import MODEL_LEVELS, PHASES, AutoCommunicator, Communicator, PhaseCounters
from hybrid.core.timeline import StepRecorder
from hybrid.core.topology import Topology
from hybrid.core.units import human_bytes
from hybrid.runtime.testbed import nic_tx_bytes, testbed_nics

__all__ = ["MetricsProcessor", "describe_auto_calibration", "log_auto_decisions", "runs_as"]


def describe_auto_calibration(comm: AutoCommunicator) -> str:
    """One status line: what auto measured at start-up (or that it had nothing to choose from)."""
    zero = (" (comm.shard_optimizer=true: only algorithms that gather the updated parameters inside the node; "
            "flat has no intra-node phase)") if comm.shards_optimizer else ""
    if comm.model is None:
        return f"comm=auto: only {comm.candidates[0]} applies to this layout{zero}; no calibration"

    def level(lv: Any) -> str:
        rate = "bandwidth unresolved" if lv.gbit_per_s is None else f"{lv.gbit_per_s:.3g} Gbit/s"
        return f"alpha {lv.alpha_s * 1e6:.0f} us, {rate}"

    levels = "; ".join(f"{name} {level(lv)}" for name in MODEL_LEVELS if (lv := getattr(comm.model, name)) is not None)
    # Without a measured cross level, sharded is priced by spreading the inter level over the NICs.
    nics = "" if comm.model.sharded_inter is not None else f"; {comm.model.nics_per_node} NIC(s) per node for sharded"
    links = "" if comm.links is None else "\n" + "\n".join(comm.links.table())
    return (f"comm=auto calibrated in {comm.calibration_s:.2f} s: {levels}{nics}; choosing among "
            f"{', '.join(comm.candidates)} per bucket size{zero}{links}")


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
        metrics.status(f"comm=auto: {human_bytes(d['bytes'])} {d['dtype']} buckets -> {d['chosen']} (predicted "
                       + ", ".join(f"{a} {s * 1e3:.1f} ms" for a, s in d["predicted_s"].items()) + ")")
    rows = [f"| {d['bytes']} | {d['dtype']} | {d['chosen']} | " + " | ".join(
        f"{d['predicted_s'][a] * 1e3:.2f}" if a in d["predicted_s"] else "-" for a in comm.candidates) + " |"
        for d in report]
    table = "\n".join([f"| bucket bytes | dtype | chosen | {' | '.join(f'{a} ms' for a in comm.candidates)} |",
                       "|" + " --- |" * (3 + len(comm.candidates)), *rows])
    metrics.text("comm_auto/decisions", table, step)


def runs_as(comm: Communicator | None, algorithm: str) -> str:
    """What actually ran: the algorithm (after any fallback), or auto's choices by bucket size."""
    if comm is None:
        return algorithm
    if isinstance(comm, AutoCommunicator):
        return ",".join(f"{d['bytes']}{'' if d['dtype'] == 'float32' else '_' + d['dtype']}:{d['chosen']}"
                        for d in comm.report()["decisions"]) or "auto"
    return comm.name


class MetricsProcessor:
    """Per-step logging and the run's final result (see the module's docstring)."""

    def __init__(self, cfg: TrainConfig, topology: Topology, metrics: Metrics, counters: PhaseCounters,
                 comm: Communicator | None = None, membership: list[dict[str, Any]] | None = None,
                 run_path: Path | None = None) -> None:
        self.cfg, self.topology, self.metrics, self.counters, self.comm = cfg, topology, metrics, counters, comm
        # The 16-bit hop's compressors whose guard it reports: comm's, or (comm=adaptive) its modes'.
        self.compressors: Callable[[], dict[str, Any]] = comm.compressors if comm is not None else dict
        # Phases reach the recorder through the counters; a caller that built counters without one gets one here.
        if counters.recorder is None:
            counters.recorder = StepRecorder(PHASES)
        self.recorder: StepRecorder = counters.recorder
        t = cfg.trainer
        # Collective (the hosts' names): every process builds its processor at the same point.
        self.accounts = StepAccounts(topology, metrics, t.straggler_margin, t.straggler_steps,
                                     _cpu_limits(cfg, topology.nnodes))
        # Collective (the clock alignment): every process builds its processor at the same point.
        self.timeline = (TimelineFile(self.recorder, t.timeline_window, topology, run_path, metrics,
                                      {"comm": cfg.comm.algorithm, "nnodes": topology.nnodes,
                                       "world_size": topology.world_size, "model": cfg.model.label})
                         if t.timeline and run_path is not None else None)
        self._phases: dict[str, Any] = {}
        self.membership = membership or []
        for entry in self.membership:  # the layout history, on the step axis where each layout began
            self.metrics.scalars(entry["step"], {"membership/world_size": float(entry["world_size"]),
                                                 "membership/nnodes": float(entry["nnodes"])})
        self.samples_per_step = cfg.data.batch_size * cfg.trainer.grad_accum_steps * topology.world_size
        self.totals = {p: [0.0, 0] for p in PHASES}
        self.step_times: list[float] = []
        self.skipped = 0
        self.loss = float("nan")
        self._interval_start, self._interval_steps = time.perf_counter(), 0
        self._auto_logged: set[str] = set()
        # On the testbed a node's first worker counts what its NICs send while training: the network bytes per
        # step of each comm, measured at the NIC, not by the comm's own counters (hsdp and ddp have none).
        self._nics = testbed_nics() if cfg.cluster.testbed.enabled and topology.local_rank == 0 else []
        self._nic_start: list[int] | None = None
        self._nic_end: list[int] | None = None  # read after the last step: the final checkpoint's gather is not a step
        # The last TAIL_STEPS steps' losses of every rank: the run's end loss over 8 x 20 batches on 2x4, where
        # final_loss (rank 0's last batch) is one batch's, too noisy to rank comms that differ in rounding.
        self._tail_losses: deque[torch.Tensor] = deque(maxlen=TAIL_STEPS)
        self.grad_norm: torch.Tensor | None = None  # the last clipped step's global gradient norm (before clipping)
        self._logged_grad_norm: float | None = None  # its value at the last log step
        self.link_watch: LinkWatch | None = None  # comm.adapt_every: the link's rate and the advice, every N steps
        self._fell_back: set[str] = set()  # compressors whose fall-back to full precision was said

    def step_skipped(self, step: int) -> None:
        self.skipped += 1
        self.metrics.status(f"step {step}: non-finite gradients, step skipped ({self.skipped} so far)")

    def step_begin(self, step: int) -> None:
        if self._nics and self._nic_start is None:
            self._nic_start = [nic_tx_bytes(n) for n in self._nics]
        if self.timeline is not None:
            self.timeline.step_begin(step)

    def step_end(self, step: int) -> None:
        """After step ``step``'s checks and checkpoint: the timeline is written after its window's last step."""
        if self.timeline is not None:
            self.timeline.step_end(step, self._phases)

    def step_done(self, done: int, loss: torch.Tensor, seconds: float, lr: float, last: int) -> None:
        """Account step ``done`` (1-based); every ``log_every`` steps and at ``last``, log it (and exchange the
        interval's per-rank accounts: collective)."""
        self.step_times.append(seconds)
        self._tail_losses.append(loss.detach())  # no host sync here: averaged once, at the end
        self._interval_steps += 1
        phases = self._phases = self.counters.snapshot(reset=True)
        for name, stats in phases.items():
            self.totals[name][0] += stats.seconds
            self.totals[name][1] += stats.bytes
        times = self.recorder.end_step()
        self.accounts.add(done, seconds, times)
        if self.link_watch is not None:
            self.link_watch.step(done, phases, seconds, times)  # collective every comm.adapt_every steps
        if done == last and self._nic_start is not None:
            self._nic_end = [nic_tx_bytes(n) for n in self._nics]
        if done % self.cfg.trainer.log_every and done != last:
            return
        self.accounts.exchange()
        self.loss = float(loss)  # the only host sync of the loss: at a log step
        rate = self.samples_per_step * self._interval_steps / (time.perf_counter() - self._interval_start)
        values = {"train/loss": self.loss, "train/lr": lr, "train/samples_per_s": rate, "train/step_time_s": seconds}
        if self.grad_norm is not None:  # trainer.grad_clip_norm: the norm it clipped by, as torch computes it
            # On every rank, at the log step: comm=hsdp's norm is a DTensor, whose value takes a collective.
            full = getattr(self.grad_norm, "full_tensor", None)
            self._logged_grad_norm = float(full() if full is not None else self.grad_norm)
            values["train/grad_norm"] = self._logged_grad_norm
        for name, stats in phases.items():
            values[f"comm/{name}_s"] = stats.seconds
            values[f"comm/{name}_bytes"] = float(stats.bytes)
        values.update(self._compression_checks(done))
        self.metrics.scalars(done, values)
        if isinstance(self.comm, AutoCommunicator):
            log_auto_decisions(self.comm, self.metrics, done, self._auto_logged)
        self.metrics.status(f"step {done}/{self.cfg.trainer.max_steps}  loss {self.loss:.4f}  lr {lr:.4g}  "
                            f"{rate:.0f} samples/s  {seconds * 1e3:.1f} ms/step")
        self._interval_start, self._interval_steps = time.perf_counter(), 0

    def finish(self, local_models: list[nn.Module], leader: nn.Module, last: int, device: torch.device,
               run_path: Path, rank: int, shard_index: int = 0, extra: dict[str, Any] | None = None,
               optimizer_bytes: int = 0) -> dict[str, Any] | None:
        """Gather every process's checksums and peak memory (collective); rank 0 writes metrics.json and the
        HParams and returns the result, the others None. Checksums agree among ranks of one ``shard_index``
        (comm=hsdp: the holders of one shard; rank 0's is then of its shard). ``extra``: more entries for
        metrics.json (rank 0's). ``optimizer_bytes``: what this process's optimizer keeps between steps."""
        if self.timeline is not None:
            self.timeline.finish(last)
        self.accounts.exchange()  # steps since the last log step (none where the run ended on one)
        checksums = [param_checksum(m) for m in local_models]
        # Linux reports the peak resident set in KiB: the high-water mark of this worker process.
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        sent = None
        if self._nic_start is not None and self.step_times:
            end = self._nic_end or [nic_tx_bytes(n) for n in self._nics]
            sent = sum(b - a for a, b in zip(self._nic_start, end)) / len(self.step_times)
        gathered: list[Any] = [None] * dist.get_world_size()  # processes: one per rank, or per node (thread mode)
        tail = float(torch.stack(list(self._tail_losses)).mean()) if self._tail_losses else math.nan
        dist.all_gather_object(gathered, (checksums, peak_rss_mb, shard_index, sent, tail, optimizer_bytes))
        if rank != 0:
            return None
        memory = {"peak_rss_mb": [g[1] for g in gathered], "optimizer_state_bytes": [g[5] for g in gathered]}
        self.metrics.scalars(last, {"memory/peak_rss_mb": max(memory["peak_rss_mb"]),
                                    "memory/optimizer_state_bytes": float(max(memory["optimizer_state_bytes"]))})
        by_shard: dict[int, set[str]] = {}
        for g in gathered:
            by_shard.setdefault(g[2], set()).update(g[0])
        result = {**self._run_facts(last), **self._speed(), **memory,
                  "param_checksum": checksums[0], "param_checksums_identical": all(len(c) == 1 for c in by_shard.values()),
                  "param_bytes": param_bytes(leader), "device": str(device), "run_dir": str(run_path),
                  "membership": self.membership, **self.accounts.summary()}
        result["tail_loss"] = statistics.fmean(g[4] for g in gathered)
        if self._logged_grad_norm is not None:  # trainer.grad_clip_norm: the last step's global norm (a log step)
            result["grad_norm"] = self._logged_grad_norm
        result["tail_loss_steps"] = len(self._tail_losses)
        per_node = [g[3] for g in gathered if g[3] is not None]
        if per_node:  # testbed: bytes each node's NICs sent per step (node order), and the busiest node's
            result["nic_tx_bytes_per_step_by_node"] = per_node
            result["nic_tx_bytes_per_step"] = max(per_node)
        if isinstance(self.comm, AutoCommunicator):
            result["comm_auto"] = self.comm.report()
        result.update(extra or {})
        self._log_hparams(result)
        write_json_atomic(run_path / "metrics.json", result)
        return result

    def _compression_checks(self, done: int) -> dict[str, float]:
        """The 16-bit hop's guard on this rank: the last check's relative error (TensorBoard
        ``comm/compression_error``), and a status line the first time it fell back to full precision."""
        compressors = self.compressors()
        values = {}
        for name, c in compressors.items():
            if c.checks:
                values["comm/compression_error"] = c.checks[-1]
            if c.fell_back and name not in self._fell_back:
                self._fell_back.add(name)
                self.metrics.status(f"{name}: the {c.kind} inter-node hop was {c.checks[-1]:.3g} off full precision "
                                    f"(> comm.max_compression_error={c.max_error:g}) by step {done}; it runs in "
                                    "full precision from now on")
        return values

    def _compression_guard(self) -> dict[str, Any]:
        """metrics.json ``compression_guard`` (rank 0's compressors): the checks' errors and whether it fell back."""
        compressors = self.compressors()
        return {name: {"checks": len(c.checks), "last_error": c.checks[-1] if c.checks else None,
                       "max_error_seen": max(c.checks) if c.checks else None, "fell_back": c.fell_back}
                for name, c in compressors.items()}

    def _run_facts(self, last: int) -> dict[str, Any]:
        cfg, topo = self.cfg, self.topology
        return {
            "comm": cfg.comm.algorithm, "shard_optimizer": cfg.comm.shard_optimizer,
            "inter_compression": cfg.comm.inter_compression,
            "torch_hook": cfg.comm.torch_hook, "nnodes": topo.nnodes,
            "nproc_per_node": topo.node_sizes[0] if topo.is_uniform else list(topo.node_sizes),
            "world_size": topo.world_size, "steps": last, "steps_run": len(self.step_times),
            "final_loss": self.loss, "samples_per_step": self.samples_per_step, "skipped_steps": self.skipped,
            "comm_s": {k: v[0] for k, v in self.totals.items()}, "bytes": {k: v[1] for k, v in self.totals.items()},
            "intra_mode": cfg.cluster.intra_mode, "model": cfg.model.label, "bucket_mb": cfg.comm.bucket_mb,
            "batch_size": cfg.data.batch_size, "runs_as": runs_as(self.comm, cfg.comm.algorithm),
            "compression_guard": self._compression_guard(),
        }

    def _speed(self) -> dict[str, float]:
        timed = self.step_times[1:] or self.step_times  # the first step includes warm-up
        mean_step = sum(timed) / len(timed) if timed else float("nan")
        # The first step apart: it includes the warm-up, and with trainer.compile the compile (compiled_first_step_s).
        first = self.step_times[0] if self.step_times else float("nan")
        return {"samples_per_s": self.samples_per_step / mean_step if timed else float("nan"),
                "mean_step_s": mean_step, "median_step_s": statistics.median(timed) if timed else float("nan"),
                "first_step_s": first, "compiled": self.cfg.trainer.compile}

    def _log_hparams(self, result: dict[str, Any]) -> None:
        cfg = self.cfg
        self.metrics.hparams(
            # A uniform layout's nproc_per_node is a number like nnodes; a mixed one its list, as text.
            {"nnodes": result["nnodes"], "nproc_per_node": result["nproc_per_node"],
             "world_size": result["world_size"], "comm": result["comm"], "intra_mode": cfg.cluster.intra_mode,
             "bucket_mb": cfg.comm.bucket_mb, "shard_optimizer": cfg.comm.shard_optimizer,
             "inter_compression": cfg.comm.inter_compression, "torch_hook": cfg.comm.torch_hook,
             "runs_as": result["runs_as"],
             "model": cfg.model.label, "width": _number(cfg.model.get("width")),
             "depth": _number(cfg.model.get("depth")), "param_bytes": result["param_bytes"],
             "batch_size": cfg.data.batch_size, "optimizer": cfg.optim.optimizer.label, "lr": _number(cfg.optim.lr)},
            {"final_loss": self.loss, "samples_per_s": result["samples_per_s"], "mean_step_s": result["mean_step_s"],
             "comm_s": sum(v[0] for v in self.totals.values()), "peak_rss_mb": max(result["peak_rss_mb"]),
             "optimizer_state_bytes": float(max(result["optimizer_state_bytes"]))},
        )


def _cpu_limits(cfg: TrainConfig, nnodes: int) -> list[float] | None:
    """Per node, the CPUs the testbed gives it (``cluster.testbed.cpu_quota``), or None: no limits. None also
    where the list no longer matches the nodes (an elastic run that lost one: which limit is whose is unknown)."""
    testbed = cfg.cluster.testbed
    if not testbed.enabled:
        return None
    try:
        return testbed.cpus(nnodes)
    except ValueError:
        return None


def _number(value: Any) -> float:
    """An hparam every run of a sweep logs as a number (a model without ``width`` logs NaN, so the HParams view
    keeps it); a number given as a string (``'0.1'``) counts as that number."""
    value = hparam_value(value)
    return float(value) if isinstance(value, (int, float)) else float("nan")
