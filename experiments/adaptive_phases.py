"""What adapting to a changing link buys: each run's wall time per phase of the link schedule, the oracle, the loss.

``python experiments/adaptive_phases.py RUN_DIR [RUN_DIR ...]`` (a Hydra multirun dir counts as its jobs), for
the runs of ``+experiment=adaptive``: the same steps and link schedule under several comms. A phase is the
steps between two changes of the schedule; its wall time comes from the TensorBoard events' wall clock at the
last step before each change (``train/loss``, logged every step), so it holds everything the steps waited for:
the link, a switch, a probe, a check. The first step (start-up) is left out of every run alike.

Printed: per run, each phase's seconds, the total, the mean loss of the last ``--tail`` steps and the switches
(metrics.json); then the oracle (per phase, the fastest run of a fixed mode, i.e. not ``comm=adaptive``) and
each run's total against it and against ``--reference`` (hierarchical).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, str(Path(__file__).parent))
from loss_curves import run_dirs  # noqa: E402 (the experiments' own helper, beside this file)


def losses(run: Path) -> dict[int, tuple[float, float]]:
    """step -> (wall time, loss) from the run's TensorBoard events."""
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {e.step: (e.wall_time, e.value) for e in events.Scalars("train/loss")}


def describe(run: Path, tail: int) -> dict:
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    schedule = [int(at) for at, _ in (cfg.cluster.testbed.link_schedule or [])]
    steps = losses(run)
    last = max(steps)
    bounds = [1, *schedule, last]
    phases = [steps[b][0] - steps[a][0] for a, b in zip(bounds, bounds[1:])]
    metrics = json.loads((run / "metrics.json").read_text())
    tail_loss = sum(steps[s][1] for s in range(last - tail + 1, last + 1)) / tail
    comm = cfg.comm.algorithm + (f" H={cfg.comm.sync_every}" if cfg.comm.algorithm == "diloco" else "")
    if cfg.comm.algorithm == "adaptive":
        comm += f" {list(cfg.comm.adapt_modes)}"
    elif cfg.comm.inter_compression != "none":
        comm += f"+{cfg.comm.inter_compression}"
    return {"run": run.name, "comm": comm, "adaptive": cfg.comm.algorithm == "adaptive", "phases": phases,
            "total": sum(phases), "tail_loss": tail_loss, "switches": metrics.get("switches", [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--tail", type=int, default=50, help="steps at the end whose mean loss is compared")
    parser.add_argument("--reference", default="hierarchical", help="the comm the others' loss is set against")
    args = parser.parse_args(argv)
    rows = [describe(run, args.tail) for run in run_dirs(args.runs)]
    fixed = [r for r in rows if not r["adaptive"]]
    if not fixed:
        print("no run of a fixed mode: no oracle to set comm=adaptive against", file=sys.stderr)
        return 2
    oracle = [min(r["phases"][k] for r in fixed) for k in range(len(fixed[0]["phases"]))]
    reference = next((r for r in rows if r["comm"] == args.reference), fixed[0])
    print(f"{'comm':>16} " + " ".join(f"phase {k + 1:>2} s" for k in range(len(oracle)))
          + f" {'total s':>8} {'vs oracle':>9} {'vs ' + reference['comm']:>16} {'loss':>7} {'loss vs':>7}  switches")
    for r in [*rows, {"comm": "oracle", "phases": oracle, "total": sum(oracle), "tail_loss": None, "switches": []}]:
        loss = "" if r["tail_loss"] is None else f"{r['tail_loss']:7.4f} {r['tail_loss'] / reference['tail_loss']:7.3f}"
        switches = ", ".join(f"{s['step']}: {s['from']} -> {s['to']}" for s in r["switches"])
        print(f"{r['comm']:>16} " + " ".join(f"{p:10.1f}" for p in r["phases"])
              + f" {r['total']:8.1f} {r['total'] / sum(oracle):9.3f} {reference['total'] / r['total']:15.2f}x"
              + f" {loss:>15}  {switches}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
