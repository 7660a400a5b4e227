"""``python experiments/auto_vs_best.py BENCH_TRAIN_JSON...``: comm=auto against the fastest fixed algorithm.

Reads ``python -m hybrid.bench train`` results that ran ``--comms flat,hierarchical,sharded,auto`` and, per
layout, finds the fixed algorithm with the most samples/s (median over the rounds), then prints auto's
samples/s over that algorithm's: per round (the runs of one round ran within minutes of each other, so a
drift of the machine between rounds cancels) and the median over the rounds. A ratio below 1 means auto
was slower; the bar is 0.95 (auto never more than 5% slower).

``--pool A.json B.json``: the files are rounds of one experiment (same model, steps and overrides), run one
after another; their rounds are put together and judged as one run of all of them.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

FIXED = ("flat", "hierarchical", "sharded")


def rows(report: dict) -> list[tuple[str, str, str, float, list[float]]]:
    """(layout, best fixed comm, auto's choices, median of per-round auto/best, per-round ratios) per layout."""
    runs, out = report["runs"], []
    for layout in report["options"]["layouts"]:
        fixed = {c: runs[f"{layout} {c}"] for c in FIXED if f"{layout} {c}" in runs}
        auto = runs.get(f"{layout} auto")
        if not fixed or not auto:
            continue
        best = max(fixed, key=lambda c: statistics.median(r["samples_per_s"] for r in fixed[c]))
        per_round = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(auto, fixed[best])]
        choices = ",".join(sorted({str(r.get("runs_as", "?")) for r in auto}))
        out.append((layout, best, choices, statistics.median(per_round), per_round))
    return out


def pooled(paths: list[str]) -> dict:
    """One report holding every round of ``paths`` (each layout's runs in file order)."""
    reports = [json.loads(Path(p).read_text()) for p in paths]
    same = {(r["param_bytes"], r["options"]["steps"], tuple(r["options"]["overrides"])) for r in reports}
    if len(same) != 1:
        raise SystemExit(f"--pool needs rounds of one experiment (model bytes, steps, overrides); got {sorted(same)}")
    out = {**reports[0], "runs": {}, "options": {**reports[0]["options"], "layouts": [], "rounds": 0}}
    for r in reports:
        out["options"]["rounds"] += r["options"]["rounds"]
        out["options"]["layouts"] += [x for x in r["options"]["layouts"] if x not in out["options"]["layouts"]]
        for key, runs in r["runs"].items():
            out["runs"].setdefault(key, []).extend(runs)
    return out


def main(args: list[str]) -> int:
    pool = bool(args) and args[0] == "--pool"
    paths = args[1:] if pool else args
    if not paths:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    worst = []
    for path, report in ([(" + ".join(paths), pooled(paths))] if pool
                         else [(p, json.loads(Path(p).read_text())) for p in paths]):
        print(f"{path}: {report['param_bytes'] / 2**20:.1f} MiB of gradients, "
              f"{report['options']['steps']} steps x {'up to ' if pool else ''}{report['options']['rounds']} rounds, "
              f"overrides {' '.join(report['options']['overrides'])}")
        print(f"{'layout':>7} {'best fixed':>13} {'auto / best':>12} {'per round':>24}  auto ran")
        for layout, best, choices, ratio, per_round in rows(report):
            worst.append(ratio)
            print(f"{layout:>7} {best:>13} {ratio:12.3f} {' '.join(f'{r:.3f}' for r in per_round):>24}  {choices}")
    if worst:
        print(f"auto / best fixed (samples/s, median over rounds): lowest {min(worst):.3f} over {len(worst)} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
