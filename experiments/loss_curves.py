"""Loss curves of trainer runs side by side, from their TensorBoard logs:
``python experiments/loss_curves.py RUN_DIR [RUN_DIR ...]`` (a Hydra multirun dir counts as its jobs).

Why this exists: comparing a compressed inter-node hop (``comm.inter_compression``)
with uncompressed training on the same seed needs the whole curve, not only the
final loss. Reads ``train/loss`` from each run's ``tb/`` with TensorBoard's own
event reader and prints one column per run; then, per run, the mean of its
logged losses over the second half of the steps and its largest absolute gap to
the first run's curve (each logged loss is one mini-batch's, so single points
are noisy; the mean over many is what shows a drift). ``--tail N``: also the
mean over each run's last N logged steps and its ratio to the first run's;
``--plot FILE``: the curves against steps (equal samples) and against wall
time, as a PNG (``--smooth N``: each point the mean of the last N losses).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def run_dirs(paths: list[str]) -> list[Path]:
    """The run directories among ``paths``; a multirun directory stands for its numbered jobs."""
    found: list[Path] = []
    for path in map(Path, paths):
        if (path / "tb").is_dir():
            found.append(path)
        else:
            jobs = sorted((p for p in path.iterdir() if (p / "tb").is_dir()), key=lambda p: p.name.zfill(8))
            if not jobs:
                raise ValueError(f"{str(path)!r} holds no run (no tb/ directory) and no multirun jobs")
            found.extend(jobs)
    return found


def loss_events(run: Path) -> list:
    """The run's train/loss events (step, value, wall time), in step order."""
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    if "train/loss" not in events.Tags()["scalars"]:
        raise ValueError(f"{str(run)!r}: its TensorBoard log holds no train/loss")
    return sorted(events.Scalars("train/loss"), key=lambda e: e.step)


def loss_curve(run: Path) -> dict[int, float]:
    return {e.step: e.value for e in loss_events(run)}


def label(run: Path) -> str:
    config = run / ".hydra" / "config.yaml"
    if not config.is_file():
        return run.name
    cfg = OmegaConf.load(config)
    name = f"{cfg.comm.algorithm}/{cfg.comm.get('inter_compression', 'none')}"
    if cfg.comm.algorithm == "diloco":
        name += f"/H{cfg.comm.sync_every}" + (f"/F{cfg.comm.fragments}" if cfg.comm.fragments > 1 else "") + (
            "/overlap" if cfg.comm.overlap else "")
        outer = cfg.comm.outer_optim
        name += f"/outer lr {outer.get('lr')} mom {outer.get('momentum', 0)}" + (" nesterov" if outer.get("nesterov") else "")
    return name


def plot(runs: list[Path], labels: list[str], path: Path, smooth: int = 1) -> None:
    """Loss against steps (every run's step has the same samples) and against wall time from its first step;
    ``smooth``: each point the mean of the last ``smooth`` logged losses (one batch's loss is noisy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for run, name in zip(runs, labels):
        events = loss_events(run)
        values = [e.value for e in events]
        means = [sum(values[max(0, i + 1 - smooth):i + 1]) / len(values[max(0, i + 1 - smooth):i + 1])
                 for i in range(len(values))]
        by_step.plot([e.step for e in events], means, label=name, linewidth=0.9)
        by_time.plot([e.wall_time - events[0].wall_time for e in events], means, label=name, linewidth=0.9)
    what = "train loss (rank 0's batch)" + (f", mean of the last {smooth} steps" if smooth > 1 else "")
    by_step.set(xlabel="step (equal samples per step)", ylabel=what)
    by_time.set(xlabel="wall time since the first logged step (s)")
    by_step.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories or Hydra multirun directories")
    parser.add_argument("--tail", type=int, default=0, help="also the mean over each run's last N logged steps")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves to this PNG")
    parser.add_argument("--smooth", type=int, default=1, help="plot each point as the mean of the last N losses")
    args = parser.parse_args(argv)
    if args.tail < 0:
        parser.error(f"--tail {args.tail} must be >= 0")
    try:
        runs = run_dirs(args.runs)
        curves = [loss_curve(r) for r in runs]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    labels = [label(r) for r in runs]
    steps = sorted(set().union(*curves))
    print(f"{'step':>6} " + " ".join(f"{name:>20}" for name in labels))
    for step in steps:
        print(f"{step:>6} " + " ".join(f"{c[step]:>20.4f}" if step in c else f"{'-':>20}" for c in curves))
    base, half = curves[0], steps[len(steps) // 2]
    for name, curve in zip(labels, curves):
        late = [v for s, v in curve.items() if s >= half]
        common = [s for s in steps if s in base and s in curve]
        gap = max(abs(curve[s] - base[s]) for s in common)
        print(f"{name}: mean loss over logged steps >= {half}: {sum(late) / len(late):.4f}; "
              f"largest gap to {labels[0]}: {gap:.4f}")
    if args.tail:
        def tail(curve: dict[int, float]) -> float:
            last = sorted(curve)[-args.tail:]
            return sum(curve[s] for s in last) / len(last)

        for name, curve in zip(labels, curves):
            print(f"{name}: mean loss over the last {min(args.tail, len(curve))} logged steps: {tail(curve):.4f} "
                  f"({tail(curve) / tail(base):.4f}x {labels[0]}'s)")
    if args.plot is not None:
        plot(runs, labels, args.plot, max(1, args.smooth))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
