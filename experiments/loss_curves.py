"""Loss curves of trainer runs side by side, from their TensorBoard logs:
``python experiments/loss_curves.py RUN_DIR [RUN_DIR ...]`` (a Hydra multirun dir counts as its jobs).

Why this exists: comparing a compressed inter-node hop (``comm.inter_compression``)
with uncompressed training on the same seed needs the whole curve, not only the
final loss. Reads ``train/loss`` from each run's ``tb/`` with TensorBoard's own
event reader and prints one column per run; then, per run, the mean of its
logged losses over the second half of the steps and its largest absolute gap to
the first run's curve (each logged loss is one mini-batch's, so single points
are noisy; the mean over many is what shows a drift).
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


def loss_curve(run: Path) -> dict[int, float]:
    events = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    if "train/loss" not in events.Tags()["scalars"]:
        raise ValueError(f"{str(run)!r}: its TensorBoard log holds no train/loss")
    return {e.step: e.value for e in events.Scalars("train/loss")}


def label(run: Path) -> str:
    config = run / ".hydra" / "config.yaml"
    if not config.is_file():
        return run.name
    cfg = OmegaConf.load(config)
    return f"{cfg.comm.algorithm}/{cfg.comm.get('inter_compression', 'none')}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories or Hydra multirun directories")
    args = parser.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
