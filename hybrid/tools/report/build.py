"""``python -m hybrid.report MULTIRUN_DIR``: a sweep's jobs -> report.md (its answer, then tables), report.png
(plot) and report_breakdown.png (where a step's time goes, per algorithm: :mod:`hybrid.tools.report.breakdown`).

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

The parts live beside this module in the package, one job each: the job as read (:mod:`hybrid.tools.report.job`), the
cost model's calibration and predictions (:mod:`hybrid.tools.report.costmodel`), the headlines
(:mod:`hybrid.tools.report.headline`) and their crossing points (:mod:`hybrid.tools.report.crossing`), the
tables (:mod:`hybrid.tools.report.tables`), report.png (:mod:`hybrid.tools.report.plot`) and the breakdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from hybrid.app.targets import label_of
from hybrid.core.costmodel import Model, calibrate
from hybrid.core.topology import Layout
from hybrid.core.units import human_rate
from hybrid.runtime.slurm_records import OUTCOME_FILE
from hybrid.runtime.testbed import per_node_rates
from hybrid.tools.report.breakdown import breakdown_figure, breakdown_table
from hybrid.tools.report.costmodel import calibrate_from_jobs, describe_model, predict_jobs
from hybrid.tools.report.format import fmt
from hybrid.tools.report.headline import headlines
from hybrid.tools.report.job import LOOPBACK, Job, is_reference
from hybrid.tools.report.loss import loss_figure
from hybrid.tools.report.plot import report_figure
from hybrid.tools.report.tables import auto_table, model_tables, peers_table

__all__ = ["Job", "calibrate_from_jobs", "comm_label", "headlines", "is_reference", "load_jobs", "main",
           "peers_table", "report_figure", "write_report"]


def model_label(node: Any) -> str:
    """``mlp w1024 d6``: the model's name and, where it has them, its width and depth knobs."""
    name = node.get("name") or label_of(str(node.get("_target_", "?")))  # runs before _target_ models had name
    knobs = [f"{k[0]}{node[k]}" for k in ("width", "depth") if node.get(k) is not None]
    return " ".join([name, *knobs])


def comm_label(comm: Any) -> str:
    """The comm as the bench names it: ``hierarchical+bf16`` (hybrid's 16-bit inter-node hop), ``ddp+fp16``
    (torch's own hook on plain DDP), ``sharded+zero`` (comm.shard_optimizer), else the algorithm; comm=diloco with its schedule, ``diloco:h32``,
    ``diloco:h32:f4:overlap+fp8`` (H, fragments, overlap; its pseudo-gradients' format)."""
    algorithm = str(comm.algorithm)
    if algorithm == "diloco":
        algorithm += f":h{comm.get('sync_every', 32)}" + (
            f":f{comm.fragments}" if comm.get("fragments", 1) > 1 else "") + (":overlap" if comm.get("overlap") else "")
    variant = comm.get("torch_hook", "none") if algorithm == "ddp" else comm.get("inter_compression", "none")
    label = algorithm if variant in (None, "none") else f"{algorithm}+{variant}"
    return f"{label}+zero" if comm.get("shard_optimizer") else label  # the optimizer sharded (docs/memory.md)


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


def slurm_note(job_dir: Path) -> str:
    """What Slurm said of a job that ran under hydra/launcher=slurm (its slurm.json), in words; "" otherwise."""
    path = job_dir / OUTCOME_FILE
    if not path.is_file():
        return ""
    outcome = json.loads(path.read_text())
    requeued = f", requeued {outcome['requeued']}x" if outcome.get("requeued") else ""
    return f" (Slurm job {outcome['job_id']}: {outcome['state']}{requeued})"


def unstarted_jobs(sweep_dir: Path) -> list[Path]:
    """Job directories Slurm ended before Hydra ran in them: a slurm.json and no .hydra/config.yaml."""
    return sorted(p.parent for p in sweep_dir.glob(f"*/{OUTCOME_FILE}") if not (p.parent / ".hydra").is_dir())


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


def write_report(sweep_dir: Path, jobs: list[Job], model: Model | None, out_md: Path, out_png: Path,
                 model_line: str | None = None) -> dict[str, Any]:
    """``model_line``: what to say about the cost model (how it was calibrated, or why it was not)."""
    errors = predict_jobs(model, jobs)
    networks = sorted({j.network for j in jobs})
    heads = headlines(jobs, model)
    lines = [f"# Sweep report: {sweep_dir}", "", f"Network: {'; '.join(networks)}.", "",
             "## Headlines (step time: mean of each run's steps, the first excluded)", "",
             *(heads or ["- no finished jobs"]), ""]
    if model_line or model:
        lines += [model_line or describe_model(model, None), ""]
    median_error = statistics.median(errors) if errors else None
    lines += [f"Median absolute prediction error of the communication time: {fmt(median_error, 100, 1)}% over "
              f"{len(errors)} job(s)." if errors else "No job's communication time was predicted.", ""]
    lines += model_tables(jobs)
    auto_lines, auto_ratios = auto_table(jobs)
    lines += auto_lines
    lines += peers_table(jobs)
    lines += breakdown_table(jobs)
    missing = [j for j in jobs if not j.ok]
    lines += ["## Jobs without metrics (failed, cancelled or still running)", ""]
    lines += [f"- {j.path.name}: {j.layout} {j.comm} {j.model}{slurm_note(j.path)}" for j in missing]
    lines += [f"- {d.name}: never started{slurm_note(d)}" for d in unstarted_jobs(sweep_dir)]
    lines += [] if lines[-1].startswith("- ") else ["- none"]
    out_md.write_text("\n".join(lines) + "\n")
    report_figure(jobs).savefig(out_png, dpi=90)
    breakdown_png = out_png.with_name(out_png.stem + "_breakdown.png")
    fig = breakdown_figure(jobs, "; ".join(networks))
    if fig is not None:
        fig.savefig(breakdown_png, dpi=90)
    loss_png = out_png.with_name(out_png.stem + "_loss.png")
    losses = loss_figure(jobs)
    if losses is not None:
        losses.savefig(loss_png, dpi=90)
    return {"jobs": len(jobs), "finished": len(jobs) - len(missing), "median_abs_error": median_error,
            "auto_over_best": auto_ratios, "breakdown_png": str(breakdown_png) if fig is not None else None,
            "loss_png": str(loss_png) if losses is not None else None, "headlines": heads}


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
    extra = "".join(f", {summary[k]}" for k in ("breakdown_png", "loss_png") if summary[k])
    print(f"wrote {args.sweep_dir / 'report.md'}, {args.sweep_dir / 'report.png'}{extra}; "
          f"{summary['finished']}/{summary['jobs']} jobs finished")
    return 0
