"""``python -m hybrid.report MULTIRUN_DIR``: a sweep's jobs -> report.md (tables), report.png (plot) and
report_breakdown.png (where a step's time goes, per algorithm: :mod:`hybrid.tools.report_breakdown`).

Reads every job directory of a Hydra multirun (``.hydra/config.yaml`` and, once
the job finished, ``metrics.json``). Jobs without metrics (failed, or still
running) are listed, never dropped. For every model size it tabulates step
time, per-phase communication time per step, samples/s and the speed-up over
``flat`` on the same cluster shape, next to the alpha-beta model's prediction
of the communication time and its error. The model is calibrated on the
sweep's own ``hierarchical`` jobs (per-phase times), or on bench JSON files
given with ``--calibrate``. Where the sweep ran ``comm=auto``, a last table
sets each auto job against the fastest fixed algorithm on the same shape and
model, with the choices auto made.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hybrid.app.targets import label_of
from hybrid.core.costmodel import Level, Model, calibrate, fit_level, predict
from hybrid.core.topology import Layout
from hybrid.tools.report_breakdown import breakdown_table, plot_breakdown

__all__ = ["Job", "comm_label", "is_reference", "load_jobs", "main", "peers_table", "write_report"]

PHASE_COLUMNS = ("intra_reduce", "inter_allreduce", "intra_broadcast", "flat_allreduce")


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

    @property
    def ok(self) -> bool:
        return self.metrics is not None

    @property
    def steps(self) -> int:
        return max(1, int(self.metrics.get("steps_run", self.metrics["steps"]))) if self.metrics else 1

    def phase_s(self, phase: str) -> float:
        return self.metrics["comm_s"].get(phase, 0.0) / self.steps if self.metrics else math.nan

    @property
    def comm_per_step_s(self) -> float:
        return sum(self.phase_s(p) for p in PHASE_COLUMNS) if self.metrics else math.nan

    @property
    def buckets(self) -> list[float]:
        """DDP buckets of this model, as sizes in bytes (the communicator's unit of work)."""
        total = float(self.metrics["param_bytes"]) if self.metrics else 0.0
        cap = self.bucket_mb * 2**20
        full, rest = divmod(total, cap)
        return [cap] * int(full) + ([rest] if rest else [])


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


def peers_table(jobs: list[Job]) -> list[str]:
    """Every finished job side by side with plain DDP on its shape and model: the peers' comparison."""
    done = [j for j in jobs if j.ok]
    if not done:
        return []
    lines = ["## Side by side with torch's own (plain DDP, its hooks, HSDP)", "",
             "| model | shape | comm | samples/s | vs ddp | peak RSS MB (largest rank) | NIC MB/step (busiest node) "
             "| final loss | tail loss (last 20 steps, all ranks) |", "|" + " --- |" * 9]
    for job in done:
        ddp = next((d for d in done if d.comm == "ddp" and d.layout == job.layout and d.model == job.model), None)
        m = job.metrics
        vs = m["samples_per_s"] / ddp.metrics["samples_per_s"] if ddp else None
        nic, rss = m.get("nic_tx_bytes_per_step"), max(m.get("peak_rss_mb") or [math.nan])
        lines.append(f"| {job.model} | {job.layout} | {job.comm} | {m['samples_per_s']:.0f} | {_fmt(vs, 1, 2)} | "
                     f"{_fmt(rss, 1, 0)} | {_fmt(nic, 1e-6, 2)} | {m['final_loss']:.4f} | "
                     f"{_fmt(m.get('tail_loss'), 1, 4)} |")
    return lines + [""]


def load_jobs(sweep_dir: Path) -> list[Job]:
    jobs = []
    for cfg_file in sorted(sweep_dir.glob("**/.hydra/config.yaml")):
        job_dir = cfg_file.parent.parent
        cfg = OmegaConf.load(cfg_file)
        metrics_file = job_dir / "metrics.json"
        metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
        jobs.append(Job(
            path=job_dir, comm=comm_label(cfg.comm),
            layout=Layout.uniform(int(cfg.cluster.nnodes), int(cfg.cluster.nproc_per_node)),
            model=model_label(cfg.model), bucket_mb=float(cfg.comm.bucket_mb),
            metrics=metrics,
        ))
    return sorted(jobs, key=lambda j: (j.model, j.layout.world_size, j.layout.nnodes, j.comm))


def calibrate_from_jobs(jobs: list[Job]) -> Model:
    """Fit both levels from finished hierarchical jobs: per step, each bucket is one phase call."""
    intra, inter = [], []
    for job in jobs:
        if not job.ok or job.comm != "hierarchical":
            continue
        n, g = job.layout.nnodes, job.layout.node_sizes[0]
        buckets = job.buckets
        size = sum(buckets)
        if g > 1:
            intra.append(((g - 1) * len(buckets), (g - 1) / g * size, job.phase_s("intra_reduce")))
        if n > 1:
            inter.append((2 * (n - 1) * len(buckets), 2 * (n - 1) / n * size, job.phase_s("inter_allreduce")))
    return Model(fit_level(intra), fit_level(inter))


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
                     f"{ratio:.3f} | {_fmt(job.comm_per_step_s)} | {by_comm.comm} | {_fmt(by_comm.comm_per_step_s)} | "
                     f"{_fmt(comm_ratio, 1, 3)} |")
    if ratios:
        lines += ["", f"auto / best step time: worst {max(ratios):.3f}, median {statistics.median(ratios):.3f} over "
                      f"{len(ratios)} shape(s) x model(s).", ""]
    return (lines if ratios else []), ratios


def _level(level: Level) -> str:
    rate = level.gbit_per_s * 1e3 if level.gbit_per_s is not None else math.inf
    return f"alpha {level.alpha_s * 1e6:.0f} us, {rate:.0f} Mbit/s"


def _fmt(value: float | None, scale: float = 1e3, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * scale:.{digits}f}"


def write_report(sweep_dir: Path, jobs: list[Job], model: Model | None, out_md: Path, out_png: Path) -> dict[str, Any]:
    errors = []
    for job in jobs:
        job.predicted_s = predict_job(model, job) if model else None
        if job.predicted_s and job.comm_per_step_s > 0:
            job.extra["error"] = job.predicted_s / job.comm_per_step_s - 1
            errors.append(abs(job.extra["error"]))
    lines = [f"# Sweep report: {sweep_dir}", ""]
    if model:
        lines += [f"Calibrated cost model: intra {_level(model.intra)}; inter {_level(model.inter)}.", ""]
    median_error = statistics.median(errors) if errors else None
    lines += [f"Median absolute prediction error of the communication time: "
              f"{_fmt(median_error, 100, 1)}% over {len(errors)} job(s).", ""]
    for model_name in sorted({j.model for j in jobs}):
        group = [j for j in jobs if j.model == model_name]
        sizes = {j.metrics["param_bytes"] for j in group if j.ok}
        size = f", {max(sizes) / 2**20:.1f} MiB of gradients" if sizes else ""
        lines += [f"## {model_name}{size}", "",
                  "| shape | comm | step ms | intra_reduce ms | inter_allreduce ms | intra_broadcast ms | flat_allreduce ms "
                  "| comm ms/step | samples/s | comm speed-up vs flat | step speed-up vs flat | predicted comm ms | error |",
                  "|" + " --- |" * 13]
        for job in [j for j in group if j.ok]:
            flat = next((f for f in group if f.ok and f.comm == "flat" and f.layout == job.layout), None)
            comm_up = flat.comm_per_step_s / job.comm_per_step_s if flat and job.comm_per_step_s > 0 else None
            step_up = flat.metrics["mean_step_s"] / job.metrics["mean_step_s"] if flat else None
            lines.append(
                f"| {job.layout} | {job.comm} | {_fmt(job.metrics['mean_step_s'])} | "
                + " | ".join("-" if is_reference(job.comm) else _fmt(job.phase_s(p)) for p in PHASE_COLUMNS)
                + f" | {'-' if is_reference(job.comm) else _fmt(job.comm_per_step_s)} | {job.metrics['samples_per_s']:.0f} | "
                f"{_fmt(comm_up, 1, 2)} | {_fmt(step_up, 1, 2)} | {_fmt(job.predicted_s)} | "
                f"{_fmt(job.extra.get('error'), 100, 0) + '%' if 'error' in job.extra else '-'} |")
        lines.append("")
    auto_lines, auto_ratios = auto_table(jobs)
    lines += auto_lines
    lines += peers_table(jobs)
    lines += breakdown_table(jobs)
    missing = [j for j in jobs if not j.ok]
    lines += ["## Jobs without metrics (failed or still running)", ""]
    lines += [f"- {j.path.name}: {j.layout} {j.comm} {j.model}" for j in missing] or ["- none"]
    out_md.write_text("\n".join(lines) + "\n")
    _plot(jobs, out_png)
    breakdown_png = out_png.with_name(out_png.stem + "_breakdown.png")
    drew = plot_breakdown(jobs, breakdown_png)
    return {"jobs": len(jobs), "finished": len(jobs) - len(missing), "median_abs_error": median_error,
            "auto_over_best": auto_ratios, "breakdown_png": str(breakdown_png) if drew else None}


def _plot(jobs: list[Job], out_png: Path) -> None:
    """Per model size: step time of every comm (top) and communication time per step (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({j.model for j in jobs if j.ok}) or ["(no finished jobs)"]
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7), squeeze=False)
    for col, model_name in enumerate(models):
        done = [j for j in jobs if j.ok and j.model == model_name]
        shapes = sorted({j.layout for j in done}, key=lambda shape: (shape.world_size, shape.nnodes))
        for row, (label, value) in enumerate((("step time", lambda j: j.metrics["mean_step_s"]),
                                              ("communication time", lambda j: j.comm_per_step_s))):
            ax = axes[row][col]
            for comm in sorted({j.comm for j in done}, key=lambda c: (is_reference(c), c)):
                if is_reference(comm) and row == 1:
                    continue  # torch runs DDP's own all-reduce: no phase counters
                points = sorted((shapes.index(j.layout), value(j) * 1e3) for j in done if j.comm == comm)
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, marker="o", label=comm)
            ax.set_xticks(range(len(shapes)), [str(s) for s in shapes])
            ax.set_xlabel("cluster shape (nodes x workers)")
            ax.set_ylabel(f"{label}, ms per step")
            ax.set_title(f"{model_name}: {label}")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)


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
    try:
        if args.calibrate:
            model: Model | None = calibrate([json.loads(f.read_text()) for f in args.calibrate])
        else:
            model = calibrate_from_jobs(jobs)
    except ValueError as exc:
        print(f"cost model not calibrated: {exc}", file=sys.stderr)
        model = None
    summary = write_report(args.sweep_dir, jobs, model, args.sweep_dir / "report.md", args.sweep_dir / "report.png")
    print((args.sweep_dir / "report.md").read_text())
    extra = f", {summary['breakdown_png']}" if summary["breakdown_png"] else ""
    print(f"wrote {args.sweep_dir / 'report.md'}, {args.sweep_dir / 'report.png'}{extra}; "
          f"{summary['finished']}/{summary['jobs']} jobs finished")
    return 0
