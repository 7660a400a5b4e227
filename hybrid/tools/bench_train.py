"""Train-mode benchmark: ``python -m hybrid.bench train --layouts 2x2 --comms ddp,flat model.width=1024``.

Where the communicator benchmark times one collective, this one runs the
trainer itself (:func:`hybrid.app.worker.run_worker`, the code ``python -m
hybrid.train`` runs) for ``--steps`` steps per configuration, so overlap of
communication with backward, DDP's bucketing, the comm hook's hand-off and
memory all count. One invocation runs every (layout, comm) configuration
``--rounds`` times, taking turns (the order reverses every other round) so a
drift of the machine hits every configuration alike, and reports per
configuration:

- samples/s: samples per step / the median step time of that run (the
  first step, with its warm-up, is left out; comm=diloco: the mean step,
  since one step in ``comm.sync_every`` carries its sync), median over the rounds;
- the ratio to the baseline comm (``ddp``: plain torch DDP) on the same layout:
  per round, this run's samples/s over the baseline's run of that round
  (back to back), then the median over rounds, and the range;
- peak RSS per rank (``ru_maxrss`` of each worker process; each run is a
  fresh set of processes) and its ratio to the baseline's;
- weak-scaling efficiency: samples/s on N workers / (N x samples/s on 1x1),
  per comm, when ``1x1`` is among the layouts.

Trailing arguments are Hydra overrides of the training config (``conf/``),
e.g. ``model.width=1024 model.depth=6 data.batch_size=8``; ``--config-dir``
adds a directory of your own configs, so the comparison runs on your model and
data (``--config-dir myconf model=mynet data=mydata``). ``--testbed-mbit``
runs every node in its own network namespace behind a shaped NIC; a comm
written ``NAME@loopback`` runs without it in the same command (the compute
ceiling, e.g. ``--comms ddp@loopback,diloco --testbed-mbit 50``). comm=diloco's
own keys among the overrides (``comm.sync_every=8``) apply to its
configurations only.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybrid.app.observability.metrics import write_json_atomic
from hybrid.core.topology import Layout
from hybrid.core.units import human_bytes

__all__ = ["TrainBenchOptions", "bench_settings", "compose_settings", "main", "run_train_bench", "summarise"]

# "hierarchical+bf16" etc.: that comm with comm.inter_compression set (its inter-node hop in 16 bits);
# "ddp+fp16" etc.: plain DDP with one of torch's own hooks (comm.torch_hook); "hsdp": torch FSDP2 on a 2-D mesh;
# "diloco+fp8" etc.: DiLoCo with its pseudo-gradients in that format. Any of them with LOOPBACK appended runs
# without the testbed's shaped NICs.
# "sharded+zero" etc.: that comm with comm.shard_optimizer (its optimizer sharded inside each node); "ddp+zero":
# plain DDP with torch's ZeroRedundancyOptimizer over the whole job.
ZERO = "zero"
BENCH_COMMS = ("ddp", "flat", "hierarchical", "sharded", "auto", "hsdp",
               *(f"{c}+{k}" for c in ("hierarchical", "sharded") for k in ("bf16", "fp16")),
               *(f"{c}+{ZERO}" for c in ("ddp", "hierarchical", "sharded", "diloco")),
               *(f"sharded+{k}+{ZERO}" for k in ("bf16", "fp16")),
               *(f"ddp+{h}" for h in ("bf16", "fp16", "powersgd")),
               "diloco", *(f"diloco+{k}" for k in ("bf16", "fp16", "fp8")))
LOOPBACK = "@loopback"


def known_comm(spec: str) -> bool:
    """Whether ``spec`` is one of BENCH_COMMS, with or without LOOPBACK."""
    return spec.removesuffix(LOOPBACK) in BENCH_COMMS


@dataclass
class TrainBenchOptions:
    layouts: list[str] = field(default_factory=lambda: ["2x2"])
    comms: list[str] = field(default_factory=lambda: ["ddp", "flat"])
    steps: int = 20
    rounds: int = 3
    baseline: str = "ddp"
    testbed_mbit: float = 0.0
    overrides: list[str] = field(default_factory=list)
    config_dirs: list[str] = field(default_factory=list)  # --config-dir: a user's configs beside the shipped ones


def compose_settings(overrides: list[str], layout: str, comm: str, steps: int, testbed_mbit: float,
                     config_dirs: list[str] | tuple[str, ...] = ()) -> Any:
    """The TrainConfig ``python -m hybrid.train`` would build for these overrides, checked."""
    from hybrid.app.checks import compose_train_config

    parsed = Layout.parse(layout)
    if not parsed.is_uniform:
        raise ValueError(f"layout {layout!r}: the trainer runs uniform layouts only (NNODESxNPROC, e.g. 2x4)")
    loopback = comm.endswith(LOOPBACK)
    algorithm, *variants = comm.removesuffix(LOOPBACK).split("+")
    zero = ZERO in variants
    variant = next((v for v in variants if v != ZERO), "")
    key = "comm.torch_hook" if algorithm == "ddp" else "comm.inter_compression"
    if algorithm != "diloco":  # comm=diloco's own keys among the overrides reach its configurations only
        from hybrid.app.config import DILOCO_KEYS

        def diloco_key(override: str) -> bool:  # comm.inter or comm.outer_optim.lr, not comm.inter_compression
            key = override.split("=", 1)[0].lstrip("+~")
            return any(key == f"comm.{k}" or key.startswith(f"comm.{k}.") for k in DILOCO_KEYS)

        overrides = [o for o in overrides if not diloco_key(o)]
    ours = [f"comm={algorithm}", *([f"{key}={variant}"] if variant else []), f"comm.shard_optimizer={zero}",
            f"cluster.nnodes={parsed.nnodes}", f"cluster.nproc_per_node={parsed.node_sizes[0]}",
            f"trainer.max_steps={steps}", f"trainer.log_every={steps}", "trainer.checkpoint_every=0",
            "trainer.resume=false", "trainer.stop_after=0"]
    if testbed_mbit and not loopback:
        ours += ["cluster.testbed.enabled=true", f"cluster.testbed.link_mbit={testbed_mbit}"]
    return compose_train_config(list(overrides) + ours, user_dirs=[Path(d) for d in config_dirs])


def _one_run(settings: Any) -> dict[str, Any]:
    from hybrid.app.train import launch_job
    from hybrid.app.worker import run_worker

    with tempfile.TemporaryDirectory(prefix="hybrid-bench-train-") as run_dir:
        result = launch_job(settings, run_worker, (settings, run_dir), Path(run_dir))[0]
    if not result.get("param_checksums_identical"):
        raise RuntimeError(f"comm={settings.comm.algorithm}: replicas diverged (parameter checksums differ)")
    # comm=diloco's steps are not alike: one in sync_every carries the exchange among nodes, which a median
    # would leave out; its speed is taken from the mean step (the others' from the median, robust to hiccups).
    step_s = result["mean_step_s"] if settings.comm.algorithm == "diloco" else result["median_step_s"]
    return {
        "samples_per_s": result["samples_per_step"] / step_s,
        "median_step_s": step_s,
        "peak_rss_mb": result["peak_rss_mb"],
        "optimizer_state_bytes": result["optimizer_state_bytes"],
        "comm_s_per_step": sum(result["comm_s"].values()) / max(1, result["steps_run"]),
        "param_bytes": result["param_bytes"],
        "final_loss": result["final_loss"],
        "tail_loss": result.get("tail_loss", float("nan")),
        "nic_tx_bytes_per_step": result.get("nic_tx_bytes_per_step"),  # testbed only: the busiest node's NICs
        "runs_as": result.get("runs_as"),  # what ran: the algorithm, or comm=auto's choices by bucket size
    }


def bench_settings(opts: TrainBenchOptions) -> dict[tuple[str, str], Any]:
    """Every (layout, comm) configuration's settings, composed and checked; the testbed, the devices and every
    component checked once (:func:`hybrid.app.checks.prepare`), so the data are generated before any clock runs."""
    from hybrid.app.checks import prepare

    settings = {(layout, comm): compose_settings(opts.overrides, layout, comm, opts.steps, opts.testbed_mbit,
                                                   opts.config_dirs)
                for layout in opts.layouts for comm in opts.comms}
    prepare(next(iter(settings.values())))
    return settings


def run_train_bench(opts: TrainBenchOptions, log: Any = print,
                    settings: dict[tuple[str, str], Any] | None = None) -> dict[str, Any]:
    """Run every configuration ``opts.rounds`` times, alternating; return every run and the summary.
    ``settings``: :func:`bench_settings`' result, where the caller has it already."""
    settings = settings or bench_settings(opts)
    runs: dict[str, list[dict[str, Any]]] = {f"{layout} {comm}": [] for layout, comm in settings}
    for r in range(opts.rounds):
        order = list(settings) if r % 2 == 0 else list(settings)[::-1]
        for layout, comm in order:
            run = _one_run(settings[(layout, comm)])
            runs[f"{layout} {comm}"].append(run)
            log(f"round {r + 1}/{opts.rounds} {layout} {comm:>17}: {run['samples_per_s']:8.1f} samples/s  "
                f"max peak RSS {max(run['peak_rss_mb']):7.1f} MB")
    return {"options": asdict(opts), "runs": runs, "summary": summarise(opts, runs),
            "host": platform.node(), "param_bytes": next(iter(runs.values()))[0]["param_bytes"]}


def summarise(opts: TrainBenchOptions, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Medians over rounds, ratios to the baseline comm, weak-scaling efficiency."""
    rows = []
    for layout in opts.layouts:
        for comm in opts.comms:
            rs = runs[f"{layout} {comm}"]
            rows.append({
                "layout": layout, "comm": comm, "world_size": Layout.parse(layout).world_size,
                "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                "samples_per_s_all": [r["samples_per_s"] for r in rs],
                "median_step_s": statistics.median(r["median_step_s"] for r in rs),
                "peak_rss_mb": statistics.median(max(r["peak_rss_mb"]) for r in rs),
                "peak_rss_mb_by_rank": [statistics.median(ranks) for ranks in zip(*(r["peak_rss_mb"] for r in rs))],
                "comm_s_per_step": statistics.median(r["comm_s_per_step"] for r in rs),
                "final_loss": statistics.median(r["final_loss"] for r in rs),
                "tail_loss": statistics.median(r.get("tail_loss", float("nan")) for r in rs),
                **({"nic_tx_bytes_per_step": statistics.median(r["nic_tx_bytes_per_step"] for r in rs)}
                   if all(r.get("nic_tx_bytes_per_step") is not None for r in rs) else {}),
                **({"optimizer_state_bytes": statistics.median(max(r["optimizer_state_bytes"]) for r in rs)}
                   if all(r.get("optimizer_state_bytes") for r in rs) else {}),
            })
    by_key = {(row["layout"], row["comm"]): row for row in rows}
    for row in rows:
        base = by_key.get((row["layout"], opts.baseline))
        if base is not None:
            # Paired: each round's run against the baseline's run of the same round (they
            # ran back to back), then the median over rounds, so a drift of the machine
            # between rounds cancels instead of adding to the spread.
            per_round = [a / b for a, b in zip(row["samples_per_s_all"], base["samples_per_s_all"])]
            row["speed_vs_baseline"] = statistics.median(per_round)
            row["speed_vs_baseline_per_round"] = per_round
            row["rss_vs_baseline"] = row["peak_rss_mb"] / base["peak_rss_mb"]
        single = by_key.get(("1x1", row["comm"]))
        if single is not None:
            row["weak_scaling_efficiency"] = row["samples_per_s"] / (row["world_size"] * single["samples_per_s"])
    return rows


def format_table(report: dict[str, Any]) -> str:
    o = report["options"]
    head = (f"trainer benchmark: {o['steps']} steps x {o['rounds']} rounds per configuration, "
            f"{human_bytes(report['param_bytes'])} of gradients"
            + (f", testbed NICs shaped to {o['testbed_mbit']:g} Mbit/s (not for comms{LOOPBACK})"
               if o["testbed_mbit"] else ", loopback")
            + (f"; overrides: {' '.join(o['overrides'])}" if o["overrides"] else ""))
    base = o["baseline"]
    cols = (f"{'layout':>7} {'comm':>17} {'samples/s':>10} {'min..max':>15} {'step ms':>8} "
            f"{'vs ' + base:>8} {'range':>10} {'peak RSS MB':>11} {'RSS vs ' + base:>11} {'optim MB':>9} "
            f"{'weak-scaling eff':>16} "
            f"{'NIC MB/step':>11} {'final loss':>10} {'tail loss':>10}")
    lines = [head, cols]
    for row in report["summary"]:
        spread = f"{min(row['samples_per_s_all']):.0f}..{max(row['samples_per_s_all']):.0f}"
        ratio = f"{row['speed_vs_baseline']:8.3f}" if "speed_vs_baseline" in row else f"{'-':>8}"
        pr = row.get("speed_vs_baseline_per_round")
        ratio += f" {min(pr):.2f}..{max(pr):.2f}" if pr else f" {'':>10}"
        rss = f"{row['rss_vs_baseline']:11.3f}" if "rss_vs_baseline" in row else f"{'-':>11}"
        eff = f"{row['weak_scaling_efficiency']:16.1%}" if "weak_scaling_efficiency" in row else f"{'-':>16}"
        nic = f"{row['nic_tx_bytes_per_step'] / 1e6:11.2f}" if "nic_tx_bytes_per_step" in row else f"{'-':>11}"
        lines.append(f"{row['layout']:>7} {row['comm']:>17} {row['samples_per_s']:10.1f} {spread:>15} "
                     f"{row['median_step_s'] * 1e3:8.1f} {ratio} {row['peak_rss_mb']:11.1f} {rss} "
                     f"{row['optimizer_state_bytes'] / 2**20 if 'optimizer_state_bytes' in row else float('nan'):9.1f} "
                     f"{eff} {nic} "
                     f"{row['final_loss']:10.4f} {row['tail_loss']:10.4f}")
    lines.append(f"samples/s and step ms: medians over the rounds; vs {base}: median over the rounds of each "
                 f"round's samples/s / {base}'s in the same round (range: smallest..largest of those); peak RSS: "
                 "the largest rank's, median over the rounds (every rank's: peak_rss_mb_by_rank in the JSON); "
                 "optim MB: the optimizer state the largest holder keeps between steps (comm+zero: its shard); "
                 "weak-scaling eff: samples/s / (workers x the same comm's 1x1 samples/s); NIC MB/step (testbed): "
                 "what the busiest node's NICs sent per step; final loss: rank 0's last step's, tail loss: every rank's "
                 "last 20 steps' mean loss (thread mode: every node's leader's), medians over the rounds (every "
                 "configuration runs the same steps on the same data)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hybrid.bench train",
        description="Run the trainer per (layout, comm) configuration, alternating, and compare samples/s and "
                    "peak memory against plain torch DDP.",
        epilog="Trailing KEY=VALUE arguments are Hydra overrides of the training config, e.g. "
               "model.width=1024 model.depth=6 data.batch_size=8",
    )
    p.add_argument("--layouts", default="2x2", help="comma-separated NNODESxNPROC layouts, e.g. 1x1,2x2,2x4 (default 2x2)")
    p.add_argument("--comms", default="ddp,flat", help=f"comma-separated subset of {','.join(BENCH_COMMS)}; "
                   f"NAME{LOOPBACK}: without the testbed (default ddp,flat)")
    p.add_argument("--steps", type=int, default=20, help="training steps per run (default 20; the first is not timed)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every configuration, alternating (default 3)")
    p.add_argument("--baseline", default="ddp", help="the comm the ratios are taken against (default ddp)")
    p.add_argument("--testbed-mbit", type=float, default=0.0,
                   help="each node in its own network namespace behind a NIC shaped to this many Mbit/s (root)")
    p.add_argument("--config-dir", action="append", default=[], dest="config_dirs",
                   help="a directory of your own configs (model/, data/, ...) beside the shipped ones, as hybrid.train's")
    p.add_argument("--output", default=None, help="JSON file (default: outputs/bench/train-<layouts>-<date>-<time>.json)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the training config")
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    comms = [x.strip() for x in args.comms.split(",") if x.strip()]
    bad = [c for c in comms if not known_comm(c)]
    if bad or not comms:
        p.error(f"--comms {args.comms!r}: allowed are {', '.join(BENCH_COMMS)}, each also with {LOOPBACK}")
    if not known_comm(args.baseline):
        p.error(f"--baseline {args.baseline!r}: allowed are {', '.join(BENCH_COMMS)}, each also with {LOOPBACK}")
    if args.steps < 2 or args.rounds < 1:
        p.error(f"--steps {args.steps} must be >= 2 and --rounds {args.rounds} >= 1")
    if args.testbed_mbit < 0:
        p.error(f"--testbed-mbit {args.testbed_mbit} must be >= 0 (0: loopback)")
    if not layouts:
        p.error("--layouts is empty: give at least one, e.g. 2x2")
    owned = ("comm", "comm.algorithm", "cluster", "cluster.nnodes", "cluster.nproc_per_node", "trainer.max_steps")
    bad_over = [o for o in args.overrides if "=" not in o or o.split("=", 1)[0].lstrip("+~") in owned
                or o.split("=", 1)[0].lstrip("+~").startswith("hydra")]
    if bad_over:
        p.error(f"override {bad_over[0]!r}: give KEY=VALUE; comm, layout and steps come from --comms, "
                "--layouts and --steps")
    missing = [d for d in args.config_dirs if not Path(d).is_dir()]
    if missing:
        p.error(f"--config-dir {missing[0]!r} does not exist or is not a directory")
    opts = TrainBenchOptions(layouts, comms, args.steps, args.rounds, args.baseline, args.testbed_mbit,
                             list(args.overrides), list(args.config_dirs))
    try:
        settings = bench_settings(opts)
    except Exception as exc:  # Hydra / OmegaConf / validation: one line
        from hybrid.app.checks import one_line_error
        from hybrid.app.config import packaged_conf_dir

        p.error(one_line_error(exc, packaged_conf_dir(), [Path(d) for d in opts.config_dirs])
                if not isinstance(exc, ValueError) else str(exc).splitlines()[0])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    output = Path(args.output) if args.output else Path("outputs") / "bench" / f"train-{'_'.join(layouts)}-{stamp}.json"
    if output.exists() and not args.overwrite:
        p.error(f"--output {output} exists: pass --overwrite or choose another path")
    report = run_train_bench(opts, settings=settings)
    print(format_table(report))
    output.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output, report)
    print(f"wrote {output}")
    return 0
