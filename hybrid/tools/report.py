"""``python -m hybrid.report MULTIRUN_DIR``: a sweep's jobs -> report.md (its answer, then tables), report.png
(plot) and report_breakdown.png (where a step's time goes, per algorithm: :mod:`hybrid.tools.report_breakdown`).

Reads every job directory of a Hydra multirun (``.hydra/config.yaml`` and, once
the job finished, ``metrics.json``). Jobs without metrics (failed, or still
running) are listed, never dropped.

report.md opens with one headline per shape (cluster layout, model and
network): the fastest comm and its step-time ratio to the runner-up and to
``flat``; why, where the metrics measured it (the busiest node's NIC bytes
per step on the testbed, with the wire time they take at the link rate, else
the communication times); and where the calibrated cost model puts the
crossing with the comm it beat (the link rate, or the gradient size, at which
their predicted communication times meet), only where that was computed and
the model reproduces the measured order. Then, for every model size, a table
of step time, rank 0's time inside each phase's calls per step, samples/s
and the speed-up over ``flat`` on the same cluster shape, next to the
alpha-beta model's prediction of the communication time and its error. The
model is calibrated on the sweep's own ``hierarchical`` jobs (per-phase
times), or on bench JSON files given with ``--calibrate``; a level it could
not fit is named, with the reason, in words. Where the sweep ran
``comm=auto``, a table sets each auto job against the fastest fixed
algorithm on the same shape and model, with the choices auto made.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from omegaconf import OmegaConf

from hybrid.app.observability.run_metrics import TAIL_STEPS
from hybrid.app.targets import label_of
from hybrid.core.costmodel import MODELLED_ALGORITHMS, Level, Model, calibrate, fit_level, predict
from hybrid.core.topology import Layout
from hybrid.runtime.testbed import per_node_rates
from hybrid.tools.report_breakdown import breakdown_figure, breakdown_table, exposed_s
from hybrid.tools.units import human_bytes, human_rate

__all__ = ["Job", "calibrate_from_jobs", "comm_label", "headlines", "is_reference", "load_jobs", "main",
           "peers_table", "report_figure", "write_report"]

PHASE_COLUMNS = ("intra_reduce", "inter_allreduce", "intra_broadcast", "flat_allreduce")
LOOPBACK = "no network limit (loopback)"


@dataclass
class Job:
    path: Path
    comm: str
    layout: Layout
    model: str
    bucket_mb: float
    metrics: dict[str, Any] | None = None
    predicted_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    network: str = LOOPBACK  # what carried the inter-node traffic, in words (the plots' titles, the headlines)
    link_mbit: list[float] | None = None  # testbed: each node's NIC rate, Mbit/s
    nics_per_node: int = 1

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    @property
    def steps(self) -> int:
        return max(1, int(self.metrics.get("steps_run", self.metrics["steps"]))) if self.metrics else 1

    @property
    def step_s(self) -> float:
        return float(self.metrics["mean_step_s"]) if self.metrics else math.nan

    def phase_s(self, phase: str) -> float:
        return self.metrics["comm_s"].get(phase, 0.0) / self.steps if self.metrics else math.nan

    @property
    def comm_per_step_s(self) -> float:
        return sum(self.phase_s(p) for p in PHASE_COLUMNS) if self.metrics else math.nan

    @property
    def buckets(self) -> list[float]:
        """DDP buckets of this model, as sizes in bytes (the communicator's unit of work)."""
        full, rest = _buckets(float(self.metrics["param_bytes"]) if self.metrics else 0.0, self.bucket_mb)
        return [self.bucket_mb * 2**20] * full + ([rest] if rest else [])

    def wire_s(self) -> float | None:
        """Seconds the busiest node's NICs need at the link rate for the bytes they sent per step (a lower bound
        on its communication), or None off the testbed or without NIC counts."""
        by_node = (self.metrics or {}).get("nic_tx_bytes_per_step_by_node")
        if not self.link_mbit or not by_node:
            return None
        rates = self.link_mbit if len(self.link_mbit) == len(by_node) else [min(self.link_mbit)] * len(by_node)
        return max(b * 8 / (r * 1e6 * self.nics_per_node) for b, r in zip(by_node, rates))


def _buckets(total: float, bucket_mb: float) -> tuple[int, float]:
    """``total`` gradient bytes as DDP buckets of ``bucket_mb``: (full buckets, bytes of the last partial one)."""
    full, rest = divmod(total, bucket_mb * 2**20)
    return int(full), rest


def model_label(node: Any) -> str:
    """``mlp w1024 d6``: the model's name and, where it has them, its width and depth knobs."""
    name = node.get("name") or label_of(str(node.get("_target_", "?")))  # runs before _target_ models had name
    knobs = [f"{k[0]}{node[k]}" for k in ("width", "depth") if node.get(k) is not None]
    return " ".join([name, *knobs])


def comm_label(comm: Any) -> str:
    """The comm as the bench names it: ``hierarchical+bf16`` (hybrid's 16-bit inter-node hop), ``ddp+fp16``
    (torch's own hook on plain DDP), else the algorithm."""
    algorithm = str(comm.algorithm)
    variant = comm.get("torch_hook", "none") if algorithm == "ddp" else comm.get("inter_compression", "none")
    return algorithm if variant in (None, "none") else f"{algorithm}+{variant}"


def is_reference(comm: str) -> bool:
    """torch's own communication (plain DDP, its hooks, FSDP2): no hybrid phases to show."""
    return comm.split("+")[0] in ("ddp", "hsdp")


def network_of(cfg: Any, job_dir: Path) -> tuple[str, list[float] | None, int]:
    """(the network in words, each node's link rate in Mbit/s or None, NICs per node) of one job."""
    testbed = OmegaConf.select(cfg, "cluster.testbed")
    if testbed is not None and testbed.get("enabled"):
        link = testbed.get("link_mbit", 500.0)
        nics = int(testbed.get("nics_per_node", 1))
        try:
            rates = per_node_rates(list(link) if OmegaConf.is_list(link) else float(link), int(cfg.cluster.nnodes))
        except (TypeError, ValueError):  # a config the trainer would have refused: name it, price nothing
            return f"testbed links {link} Mbit/s (not one rate per node)", None, nics
        text = (human_rate(rates[0]) if len(set(rates)) == 1
                else "/".join(f"{r:g}" for r in rates) + " Mbit/s (per node)")
        return f"testbed links {text}" + (f", {nics} NICs per node" if nics > 1 else ""), rates, nics
    hydra_file = job_dir / ".hydra" / "hydra.yaml"
    launcher = str(OmegaConf.select(OmegaConf.load(hydra_file), "hydra.launcher._target_", default="")
                   if hydra_file.is_file() else "").lower()
    if "slurm" in launcher and "local" not in launcher:
        return "the cluster's own network (Slurm)", None, 1
    return LOOPBACK, None, 1


def load_jobs(sweep_dir: Path) -> list[Job]:
    jobs = []
    for cfg_file in sorted(sweep_dir.glob("**/.hydra/config.yaml")):
        job_dir = cfg_file.parent.parent
        cfg = OmegaConf.load(cfg_file)
        metrics_file = job_dir / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
        network, rates, nics = network_of(cfg, job_dir)
        jobs.append(Job(
            path=job_dir, comm=comm_label(cfg.comm),
            layout=Layout.uniform(int(cfg.cluster.nnodes), int(cfg.cluster.nproc_per_node)),
            model=model_label(cfg.model), bucket_mb=float(cfg.comm.bucket_mb),
            metrics=metrics, network=network, link_mbit=rates, nics_per_node=nics,
        ))
    return sorted(jobs, key=lambda j: (j.model, j.layout.world_size, j.layout.nnodes, j.comm))


def _level_points(jobs: list[Job]) -> dict[str, list[tuple[float, float, float]]]:
    """(steps, bytes, seconds) per step of finished hierarchical jobs: per step, each bucket is one phase call."""
    points: dict[str, list[tuple[float, float, float]]] = {"intra": [], "inter": []}
    for job in jobs:
        if not job.ok or job.comm != "hierarchical":
            continue
        n, g = job.layout.nnodes, job.layout.node_sizes[0]
        buckets = job.buckets
        size = sum(buckets)
        if g > 1:
            points["intra"].append(((g - 1) * len(buckets), (g - 1) / g * size, job.phase_s("intra_reduce")))
        if n > 1:
            points["inter"].append((2 * (n - 1) * len(buckets), 2 * (n - 1) / n * size,
                                    job.phase_s("inter_allreduce")))
    return points


def _one_call_size(points: list[tuple[float, float, float]]) -> bool:
    return len({round(b / s, 3) for s, b, _ in points if s > 0}) <= 1


def calibrate_from_jobs(jobs: list[Job]) -> Model:
    """Fit both levels from finished hierarchical jobs (rank 0's intra_reduce and inter_allreduce per step);
    ValueError naming the level and why it could not be fitted."""
    levels = {}
    for name, points in _level_points(jobs).items():
        what = "more than one worker per node" if name == "intra" else "more than one node"
        if not points:
            raise ValueError(f"{name}: not fitted (no finished hierarchical job with {what})")
        if len(points) < 2 or _one_call_size(points):
            raise ValueError(f"{name}: not fitted (all {name} calls the same size: latency and bandwidth cannot "
                             f"be told apart; hierarchical jobs of other node sizes or models would separate them)")
        levels[name] = fit_level(points)
    return Model(levels["intra"], levels["inter"])


def describe_model(model: Model, jobs: list[Job] | None) -> str:
    """One line on the fitted levels, in words where a part of a level was not resolved (never inf or nan).
    ``jobs``: the sweep the model was fitted on (for the reason), or None (bench files)."""
    points = _level_points(jobs) if jobs is not None else {}

    def level(name: str, lv: Level) -> str:
        alpha = f"alpha {lv.alpha_s * 1e6:.0f} us" if lv.alpha_s > 0 else "alpha below resolution (fitted <= 0)"
        if lv.gbit_per_s is not None:
            return f"{name} {alpha}, {human_rate(lv.gbit_per_s * 1e3)}"
        pts = points.get(name)
        why = (f"all {name} calls the same size" if pts and _one_call_size(pts) else
               "the time per call did not grow with its size across the calibration runs: the least-squares "
               "per-byte cost came out <= 0")
        return f"{name}: bandwidth not fitted ({why}), priced by latency alone, {alpha}"

    source = "this sweep's hierarchical jobs (rank 0's phase times)" if jobs is not None else "the bench files"
    return f"Cost model calibrated on {source}: {level('intra', model.intra)}; {level('inter', model.inter)}."


FIXED = ("flat", "hierarchical", "sharded")


def auto_choice(job: Job, nbytes: float) -> str:
    """The algorithm an auto job ran for buckets of about ``nbytes``: its decision for the nearest size."""
    decisions = job.metrics.get("comm_auto", {}).get("decisions", []) if job.metrics else []
    if not decisions:
        return "flat"
    return min(decisions, key=lambda d: abs(d["bytes"] - nbytes))["chosen"]


def predict_job(model: Model, job: Job) -> float | None:
    if not job.ok or is_reference(job.comm) or "+" in job.comm or job.layout.world_size == 1:
        return None  # torch's own comms, and 16-bit hops, which the cost model does not price
    return sum(predict(model, auto_choice(job, b) if job.comm == "auto" else job.comm, job.layout, b)["total"]
               for b in job.buckets)


def auto_table(jobs: list[Job]) -> tuple[list[str], list[float]]:
    """Markdown rows: each finished auto job against the fastest fixed algorithm on its shape and model, by
    median step time (the first step excluded) and by communication time per step; and the step-time ratios."""
    lines = ["## comm=auto against the fastest fixed algorithm", "",
             "auto / best > 1 means auto was slower. Step: median step time (the first step excluded); "
             "comm: communication seconds per step (what auto's choice changes).", "",
             "| model | shape | auto choices (bucket bytes: algorithm) | auto step ms | best fixed | best step ms "
             "| auto / best | auto comm ms | best fixed by comm | best comm ms | auto / best comm |",
             "|" + " --- |" * 11]
    ratios = []
    for job in [j for j in jobs if j.ok and j.comm == "auto"]:
        fixed = [f for f in jobs if f.ok and f.comm in FIXED and f.layout == job.layout and f.model == job.model]
        if not fixed:
            continue
        best = min(fixed, key=lambda f: f.metrics["median_step_s"])
        ratio = job.metrics["median_step_s"] / best.metrics["median_step_s"]
        ratios.append(ratio)
        by_comm = min(fixed, key=lambda f: f.comm_per_step_s)
        comm_ratio = job.comm_per_step_s / by_comm.comm_per_step_s if by_comm.comm_per_step_s > 0 else None
        lines.append(f"| {job.model} | {job.layout} | {job.metrics.get('runs_as', '-')} | "
                     f"{_fmt(job.metrics['median_step_s'])} | {best.comm} | {_fmt(best.metrics['median_step_s'])} | "
                     f"{_fmt(ratio, 1, 3)} | {_fmt(job.comm_per_step_s)} | {by_comm.comm} | "
                     f"{_fmt(by_comm.comm_per_step_s)} | {_fmt(comm_ratio, 1, 3)} |")
    if ratios:
        lines += ["", f"auto / best step time: worst {max(ratios):.3f}, median {statistics.median(ratios):.3f} over "
                      f"{len(ratios)} shape(s) x model(s).", ""]
    return (lines if ratios else []), ratios


def peers_table(jobs: list[Job]) -> list[str]:
    """Every finished job side by side with plain DDP on its shape and model: the peers' comparison. The tail
    loss (every rank's loss over the last TAIL_STEPS steps) is shown only for runs longer than that window;
    over a shorter run it would be the mean of the whole run, not its end."""
    done = [j for j in jobs if j.ok]
    if not done:
        return []
    tail = any(j.steps > TAIL_STEPS and j.metrics.get("tail_loss") is not None for j in done)
    lines = ["## Side by side with torch's own (plain DDP, its hooks, HSDP)", "",
             "| model | shape | comm | samples/s | vs ddp | peak RSS MB (largest rank) | NIC MB/step (busiest node) "
             "| final loss |" + (f" loss, mean of the last {TAIL_STEPS} steps (all ranks) |" if tail else ""),
             "|" + " --- |" * (9 if tail else 8)]
    for job in done:
        ddp = next((d for d in done if d.comm == "ddp" and d.layout == job.layout and d.model == job.model), None)
        m = job.metrics
        vs = m["samples_per_s"] / ddp.metrics["samples_per_s"] if ddp else None
        nic, rss = m.get("nic_tx_bytes_per_step"), max(m.get("peak_rss_mb") or [math.nan])
        tail_loss = m.get("tail_loss") if job.steps > TAIL_STEPS else None
        lines.append(f"| {job.model} | {job.layout} | {job.comm} | {_fmt(m['samples_per_s'], 1, 0)} | "
                     f"{_fmt(vs, 1, 2)} | {_fmt(rss, 1, 0)} | {_fmt(nic, 1e-6, 2)} | {_fmt(m.get('final_loss'), 1, 4)} |"
                     + (f" {_fmt(tail_loss, 1, 4)} |" if tail else ""))
    if tail:
        lines += ["", f"Loss over the last {TAIL_STEPS} steps: '-' for runs of {TAIL_STEPS} steps or fewer, where "
                      "it would be the whole run's mean."]
    return lines + [""]


def _fmt(value: float | None, scale: float = 1e3, digits: int = 1) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{round(value * scale, digits) + 0.0:.{digits}f}"  # + 0.0 turns -0.0 into 0.0: no '-0'


def _ms(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.2g} ms"


def _comm_per_step(model: Model, algorithm: str, layout: Layout, total: float, bucket_mb: float) -> float:
    """Predicted communication seconds per step of ``algorithm`` for ``total`` gradient bytes in DDP buckets."""
    full, rest = _buckets(total, bucket_mb)
    cost = full * predict(model, algorithm, layout, bucket_mb * 2**20)["total"] if full else 0.0
    return cost + (predict(model, algorithm, layout, rest)["total"] if rest else 0.0)


def _crossing(diff: Callable[[float], float], lo: float, hi: float, near: float) -> tuple[float, bool] | None:
    """The x in [lo, hi] where ``diff`` changes sign nearest ``near`` (log scale), by bisection, and whether
    diff is negative below it; None where it keeps one sign over the range."""
    xs = [lo * (hi / lo) ** (k / 240) for k in range(241)]
    signs = [diff(x) < 0 for x in xs]
    brackets = [(xs[k], xs[k + 1], signs[k]) for k in range(240) if signs[k] != signs[k + 1]]
    if not brackets:
        return None
    a, b, below = min(brackets, key=lambda br: abs(math.log(math.sqrt(br[0] * br[1]) / near)))
    for _ in range(60):
        mid = math.sqrt(a * b)
        a, b = (mid, b) if (diff(mid) < 0) == below else (a, mid)
    return math.sqrt(a * b), below


def _flip(model: Model, win: Job, other: Job) -> str:
    """Where the cost model says ``other`` would beat ``win``: the link rate and the gradient size at which their
    predicted communication times cross; a sentence saying why not where it cannot say."""
    algs = (win.comm, other.comm)
    if not all(a in MODELLED_ALGORITHMS for a in algs) or win.layout.world_size == 1:
        return ""  # torch's own comms, 16-bit hops and auto: the model does not price them as one algorithm
    unfitted = [n for n in ("intra", "inter") if getattr(model, n).gbit_per_s is None]
    if unfitted:
        return f"No crossing point: the cost model's {' and '.join(unfitted)} bandwidth was not fitted."
    layout, size = win.layout, float(win.metrics["param_bytes"])

    def gap(m: Model, total: float) -> float:  # win minus other, predicted seconds per step
        return (_comm_per_step(m, win.comm, layout, total, win.bucket_mb)
                - _comm_per_step(m, other.comm, layout, total, other.bucket_mb))

    now_win, now_other = (_comm_per_step(model, a, layout, size, j.bucket_mb) for a, j in zip(algs, (win, other)))
    if now_win >= now_other:
        return (f"The cost model does not reproduce this order (it predicts {win.comm} {_ms(now_win)} and "
                f"{other.comm} {_ms(now_other)} of communication per step), so it gives no crossing point.")
    overtakes, never = [], []
    if layout.nnodes > 1:
        fitted = model.inter.gbit_per_s * 1e3

        def at_rate(mbit: float) -> float:
            return gap(replace(model, inter=Level(model.inter.alpha_s, 8 / (mbit * 1e6))), size)

        found = _crossing(at_rate, 1.0, 1e6, fitted)
        if found is None:
            never.append(f"link rate from 1 Mbit/s to 1 Tbit/s (the fitted inter-node level: {human_rate(fitted)})")
        else:
            overtakes.append(f"links {'faster' if found[1] else 'slower'} than {human_rate(found[0])} (the nearest "
                             f"crossing; the fitted inter-node level: {human_rate(fitted)})")
    found = _crossing(lambda total: gap(model, total), size / 100, size * 100, size)
    if found is None:
        never.append(f"gradient size from {human_bytes(size / 100)} to {human_bytes(size * 100)}")
    else:
        overtakes.append(f"gradients {'larger' if found[1] else 'smaller'} than {human_bytes(found[0])}")
    out = []
    if overtakes:
        out.append(f"By the cost model's predicted communication per step, {other.comm} would overtake {win.comm} "
                   f"with {'; or with '.join(overtakes)}.")
    if never:
        out.append(f"{'It' if overtakes else 'The cost model'} keeps {win.comm} ahead of {other.comm} at every "
                   f"{' and every '.join(never)}.")
    return " ".join(out)


def _reason(win: Job, other: Job) -> str:
    """Why ``win`` beat ``other``, from what both jobs measured: NIC bytes (testbed), else time in phase calls,
    else exposed communication (per-rank accounts); empty where neither has it."""
    nic = [j.metrics.get("nic_tx_bytes_per_step") for j in (other, win)]
    if all(b is not None for b in nic):
        wires = [j.wire_s() for j in (other, win)]
        rates = {r for j in (other, win) for r in j.link_mbit or []}
        at = human_rate(rates.pop()) if len(rates) == 1 else "the nodes' link rates"
        wire = (f" (at least {_ms(wires[0])} and {_ms(wires[1])} on the wire at {at})"
                if all(w is not None for w in wires) else "")
        return (f"The busiest node's NIC sends {nic[0] / 1e6:.0f} MB per step under {other.comm}, "
                f"{nic[1] / 1e6:.0f} MB under {win.comm}{wire}.")
    if not is_reference(win.comm) and not is_reference(other.comm):
        return (f"Communication per step (rank 0's time in phase calls): {other.comm} "
                f"{_ms(other.comm_per_step_s)}, {win.comm} {_ms(win.comm_per_step_s)}.")
    exposed = [exposed_s(j.metrics) for j in (other, win)]
    if all(e is not None for e in exposed):
        return (f"Communication the step waited for (exposed, mean over ranks): {other.comm} {_ms(exposed[0])}, "
                f"{win.comm} {_ms(exposed[1])}.")
    return ""


def headlines(jobs: list[Job], model: Model | None) -> list[str]:
    """One markdown bullet per shape (model, cluster layout, network): who won, by how much, why, and where
    the cost model says the answer would flip."""
    groups: dict[tuple[str, Layout, str], list[Job]] = {}
    for job in jobs:
        if job.ok and math.isfinite(job.step_s):
            groups.setdefault((job.model, job.layout, job.network), []).append(job)
    lines = []
    for (model_name, layout, network), group in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1].world_size, kv[0][1].nnodes, kv[0][2])):
        ranked = sorted(group, key=lambda j: j.step_s)
        size = max(j.metrics["param_bytes"] for j in group) / 2**20
        label = f"**{layout}, {model_name} ({size:.1f} MiB), {network}:**"
        if len(ranked) == 1:
            lines.append(f"- {label} only {ranked[0].comm} finished on this shape: nothing to compare.")
            continue
        win, runner = ranked[0], ranked[1]
        flat = next((j for j in ranked if j.comm == "flat"), None)
        ratio = runner.step_s / win.step_s
        text = (f"{win.comm} is fastest, {ratio:.2f}x faster per step than {runner.comm} (runner-up; "
                f"{_ms(win.step_s)} against {_ms(runner.step_s)})" if f"{ratio:.2f}" != "1.00" else
                f"{win.comm} and {runner.comm} tie for fastest ({_ms(win.step_s)} and {_ms(runner.step_s)} per step)")
        if flat is not None and flat not in (win, runner):
            text += f" and {flat.step_s / win.step_s:.2f}x faster than flat ({_ms(flat.step_s)})"
        other = flat if flat is not None and flat is not win else runner
        sentences = [text + ".", _reason(win, other), _flip(model, win, other) if model else ""]
        lines.append(f"- {label} " + " ".join(s for s in sentences if s))
    return lines


def write_report(sweep_dir: Path, jobs: list[Job], model: Model | None, out_md: Path, out_png: Path,
                 model_line: str | None = None) -> dict[str, Any]:
    """``model_line``: what to say about the cost model (how it was calibrated, or why it was not)."""
    errors = []
    for job in jobs:
        job.predicted_s = predict_job(model, job) if model else None
        if job.predicted_s and job.comm_per_step_s > 0:
            job.extra["error"] = job.predicted_s / job.comm_per_step_s - 1
            errors.append(abs(job.extra["error"]))
    networks = sorted({j.network for j in jobs})
    heads = headlines(jobs, model)
    lines = [f"# Sweep report: {sweep_dir}", "", f"Network: {'; '.join(networks)}.", "",
             "## Headlines (step time: mean of each run's steps, the first excluded)", "",
             *(heads or ["- no finished jobs"]), ""]
    if model_line or model:
        lines += [model_line or describe_model(model, None), ""]
    median_error = statistics.median(errors) if errors else None
    lines += [f"Median absolute prediction error of the communication time: {_fmt(median_error, 100, 1)}% over "
              f"{len(errors)} job(s)." if errors else "No job's communication time was predicted.", ""]
    for model_name in sorted({j.model for j in jobs}):
        group = [j for j in jobs if j.model == model_name]
        sizes = {j.metrics["param_bytes"] for j in group if j.ok}
        size = f", {max(sizes) / 2**20:.1f} MiB of gradients" if sizes else ""
        lines += [f"## {model_name}{size}", "",
                  "| shape | comm | step ms | " + " | ".join(f"{p} ms (time in call)" for p in PHASE_COLUMNS)
                  + " | comm ms/step (time in calls) | samples/s | comm speed-up vs flat | step speed-up vs flat "
                  "| predicted comm ms | error |", "|" + " --- |" * 13]
        for job in [j for j in group if j.ok]:
            flat = next((f for f in group if f.ok and f.comm == "flat" and f.layout == job.layout), None)
            comm_up = flat.comm_per_step_s / job.comm_per_step_s if flat and job.comm_per_step_s > 0 else None
            step_up = flat.step_s / job.step_s if flat else None
            lines.append(
                f"| {job.layout} | {job.comm} | {_fmt(job.step_s)} | "
                + " | ".join("-" if is_reference(job.comm) else _fmt(job.phase_s(p)) for p in PHASE_COLUMNS)
                + f" | {'-' if is_reference(job.comm) else _fmt(job.comm_per_step_s)} | "
                f"{_fmt(job.metrics['samples_per_s'], 1, 0)} | {_fmt(comm_up, 1, 2)} | {_fmt(step_up, 1, 2)} | "
                f"{_fmt(job.predicted_s)} | {_fmt(job.extra.get('error'), 100, 0) + '%' if 'error' in job.extra else '-'} |")
        lines += ["", "Time in call: rank 0's seconds inside each phase's calls, per step (the run's total over its "
                      "steps), whether or not backward hid them; rank 0 leads node 0, so its intra_broadcast only "
                      "sends, while the other ranks' wait in theirs shows in the breakdown's exposed times. "
                      "torch's own comms (ddp, hsdp) have no phase counters: '-'.", ""]
    auto_lines, auto_ratios = auto_table(jobs)
    lines += auto_lines
    lines += peers_table(jobs)
    lines += breakdown_table(jobs)
    missing = [j for j in jobs if not j.ok]
    lines += ["## Jobs without metrics (failed or still running)", ""]
    lines += [f"- {j.path.name}: {j.layout} {j.comm} {j.model}" for j in missing] or ["- none"]
    out_md.write_text("\n".join(lines) + "\n")
    report_figure(jobs).savefig(out_png, dpi=90)
    breakdown_png = out_png.with_name(out_png.stem + "_breakdown.png")
    fig = breakdown_figure(jobs, "; ".join(networks))
    if fig is not None:
        fig.savefig(breakdown_png, dpi=90)
    return {"jobs": len(jobs), "finished": len(jobs) - len(missing), "median_abs_error": median_error,
            "auto_over_best": auto_ratios, "breakdown_png": str(breakdown_png) if fig is not None else None,
            "headlines": heads}


def report_figure(jobs: list[Job]) -> Any:
    """report.png's matplotlib Figure: per model size, step time of every comm (top) and communication time per
    step (bottom) against cluster shape; every y axis from 0; the network in the title.

    The communication panel draws two measures, never mixed in one line: solid, rank 0's time inside the
    phase calls (hybrid's comms: their counters); dashed, the communication the step waited for (exposed:
    the breakdown's phases and comm_wait outside them, mean over ranks), for every comm whose metrics hold
    per-rank accounts. torch's own comms (ddp, hsdp) have no phase counters, so they appear dashed only;
    where they ran without accounts (older runs), a note in the panel says they are not drawn.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    models = sorted({j.model for j in jobs if j.ok}) or ["(no finished jobs)"]
    comms = sorted({j.comm for j in jobs if j.ok}, key=lambda c: (is_reference(c), c))
    color = {c: colormaps["tab10"].colors[k % 10] for k, c in enumerate(comms)}
    fig = Figure(figsize=(6 * len(models), 7.5))
    axes = fig.subplots(2, len(models), squeeze=False)
    for col, model_name in enumerate(models):
        done = [j for j in jobs if j.ok and j.model == model_name]
        shapes = sorted({j.layout for j in done}, key=lambda shape: (shape.world_size, shape.nnodes))
        step_ax, comm_ax = axes[0][col], axes[1][col]
        undrawn = []
        for comm in comms:
            mine = [j for j in done if j.comm == comm]
            _line(step_ax, shapes, [(j.layout, j.step_s) for j in mine], comm, color[comm], exposed=False)
            if not is_reference(comm):
                _line(comm_ax, shapes, [(j.layout, j.comm_per_step_s) for j in mine], f"{comm}, in calls",
                      color[comm], exposed=False)
            exposed = [(j.layout, e) for j in mine if (e := exposed_s(j.metrics)) is not None]
            label = f"{comm}, exposed" + (" (no phase counters)" if is_reference(comm) else "")
            _line(comm_ax, shapes, exposed, label, color[comm], exposed=True)
            missing = [str(j.layout) for j in mine if is_reference(comm) and exposed_s(j.metrics) is None]
            if missing:
                undrawn.append(f"{comm} at {', '.join(missing)}")
        if undrawn:
            comm_ax.set_ylim(0, comm_ax.get_ylim()[1] * 1.12)  # headroom for the note above the lines
            comm_ax.text(0.02, 0.97, f"{'; '.join(undrawn)}: no phase counters and no per-rank accounts: not drawn",
                         transform=comm_ax.transAxes, va="top", fontsize=7)
        comm_note = "\nsolid: in phase calls (rank 0); dashed: exposed (waited on)"
        for ax, label, note in ((step_ax, "step time", ""), (comm_ax, "communication time", comm_note)):
            ax.set_xticks(range(len(shapes)), [str(s) for s in shapes])
            ax.set_xlabel("cluster shape (nodes x workers)")
            ax.set_ylabel(f"{label}, ms per step")
            ax.set_title(f"{model_name}: {label}{note}", fontsize=9)
            ax.set_ylim(bottom=0)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle("; ".join(sorted({j.network for j in jobs})), fontsize=11)
    fig.tight_layout()
    return fig


def _line(ax: Any, shapes: list[Layout], points: list[tuple[Layout, float]], label: str, color: Any,
          exposed: bool) -> None:
    """One comm's points against shape, in ms; exposed ones dashed and hollow (told apart on a single shape too)."""
    points = sorted((shapes.index(shape), value * 1e3) for shape, value in points if math.isfinite(value))
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="s" if exposed else "o", linestyle="--" if exposed else "-", color=color,
                markerfacecolor="none" if exposed else color, label=label)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hybrid.report", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", type=Path, help="a Hydra multirun directory (multirun/<date>_<time>)")
    p.add_argument("--calibrate", nargs="+", type=Path, metavar="BENCH_JSON",
                   help="calibrate the cost model on hybrid.tools.bench results instead of the sweep itself")
    args = p.parse_args(argv)
    if not args.sweep_dir.is_dir():
        p.error(f"sweep dir {str(args.sweep_dir)!r} does not exist")
    jobs = load_jobs(args.sweep_dir)
    if not jobs:
        p.error(f"{str(args.sweep_dir)!r} holds no Hydra jobs (no */.hydra/config.yaml)")
    model: Model | None = None
    try:
        if args.calibrate:
            model = calibrate([json.loads(f.read_text()) for f in args.calibrate])
        else:
            model = calibrate_from_jobs(jobs)
        model_line = describe_model(model, None if args.calibrate else jobs)
    except ValueError as exc:
        model_line = f"No cost model: {exc}."
        print(f"cost model not calibrated: {exc}", file=sys.stderr)
    summary = write_report(args.sweep_dir, jobs, model, args.sweep_dir / "report.md", args.sweep_dir / "report.png",
                           model_line)
    print((args.sweep_dir / "report.md").read_text())
    extra = f", {summary['breakdown_png']}" if summary["breakdown_png"] else ""
    print(f"wrote {args.sweep_dir / 'report.md'}, {args.sweep_dir / 'report.png'}{extra}; "
          f"{summary['finished']}/{summary['jobs']} jobs finished")
    return 0
