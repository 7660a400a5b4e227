#!/usr/bin/env bash
# What per-rank accounting and the timeline cost: median step time of 2x2 hierarchical and flat on loopback,
# before per-rank accounting existed (BEFORE, a commit), with accounting only (timeline off, the default) and with the timeline
# recording every step (the worst case; its default window is 3 steps). Rounds alternate A, B, C.
#   experiments/timeline_overhead.sh [BEFORE_COMMIT] [ROUNDS]
# Results: experiments/perf/timeline/*.json, summary printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
before=${1:-0e74ba3}
rounds=${2:-3}
out=experiments/perf/timeline
mkdir -p "$out"
# The editable install serves hybrid/ and conf/ from this checkout: the before-runs put BEFORE's in place and
# the trap puts HEAD's back (commit first).
git diff --quiet HEAD -- hybrid conf || { echo "commit or stash hybrid/ and conf/ first" >&2; exit 2; }
trap 'git checkout -q HEAD -- hybrid conf' EXIT
common=(--layouts 2x2 --comms hierarchical,flat --steps 60 --rounds 1 model.width=512 model.depth=6
        data.batch_size=32 comm.bucket_mb=1)
for r in $(seq 1 "$rounds"); do
  git checkout -q "$before" -- hybrid conf
  python -m hybrid.bench train "${common[@]}" --output "$out/before-r$r.json" --overwrite >/dev/null
  git checkout -q HEAD -- hybrid conf
  python -m hybrid.bench train "${common[@]}" --output "$out/off-r$r.json" --overwrite >/dev/null
  python -m hybrid.bench train "${common[@]}" trainer.timeline=true "trainer.timeline_steps=[1,60]" \
     --output "$out/on-r$r.json" --overwrite >/dev/null
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
for comm in ("hierarchical", "flat"):
    med = {v: [] for v in ("before", "off", "on")}
    for v in med:
        for r in range(1, rounds + 1):
            report = json.load(open(f"{out}/{v}-r{r}.json"))
            (run,) = report["runs"][f"2x2 {comm}"]
            med[v].append(run["median_step_s"])
    line = "  ".join(f"{v} {statistics.median(x) * 1e3:.1f} ms ({', '.join(f'{y * 1e3:.1f}' for y in x)})"
                     for v, x in med.items())
    print(f"2x2 {comm}: {line};  off/before {statistics.median(med['off']) / statistics.median(med['before']):.3f}, "
          f"on/off {statistics.median(med['on']) / statistics.median(med['off']):.3f}")
PY
