"""Rank 0's peak memory at a checkpoint, comm=diloco against comm=ddp, the same model and layout.

Each run is ``python -m hybrid.train`` on 2x4 with Hugging Face GPT-2 (the RESULTS 12.1 configuration: width 256,
8 layers, 4 heads, context 64) and AdamW, 8 steps, a checkpoint every 4 (so two, the last at the end; DiLoCo
syncs every 4, and its checkpoints hold every node's model, inner and outer state). The figure is rank 0's peak
resident set (metrics.json ``peak_rss_mb[0]``: the process's high-water mark, checkpoints included), the median
of ``--runs`` runs each, and DiLoCo's over DDP's.

    python experiments/recovery/checkpoint_peak.py --runs 3

``--source DIR``: run the hybrid found in DIR (another checkout, e.g. the commit before a change) instead of
this one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model=gpt2", "data=text", "optim=adamw", "model.width=256", "model.depth=8", "model.heads=4",
         "data.batch_size=4", "data.seq_len=64"]
COMMS = {"ddp": ["comm=ddp"], "diloco": ["comm=diloco", "comm.sync_every=4"]}


def one_run(comm: str, source: Path, where: Path) -> float:
    env = {**os.environ, "PYTHONPATH": f"{source}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "hybrid.train", "cluster=2x4", *COMMS[comm], *MODEL,
                           "trainer.max_steps=8", "trainer.checkpoint_every=4", "trainer.log_every=4",
                           "hydra.run.dir=run"],
                          cwd=where, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"{comm} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return float(json.loads((where / "run" / "metrics.json").read_text())["peak_rss_mb"][0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--source", type=Path, default=ROOT, help="the hybrid checkout to run")
    args = parser.parse_args()
    peaks: dict[str, list[float]] = {comm: [] for comm in COMMS}
    for _ in range(args.runs):  # alternating, so a slow period of the machine hits both alike
        for comm in COMMS:
            with tempfile.TemporaryDirectory(prefix="hybrid-peak-") as where:
                peaks[comm].append(one_run(comm, args.source.resolve(), Path(where)))
    ddp = statistics.median(peaks["ddp"])
    print("| comm | rank 0's peak RSS MB, each run | median | vs ddp |")
    print("| --- | --- | --- | --- |")
    for comm, values in peaks.items():
        median = statistics.median(values)
        print(f"| {comm} | {', '.join(f'{v:.0f}' for v in values)} | {median:.0f} | {median / ddp:.3f} |")


if __name__ == "__main__":
    main()
