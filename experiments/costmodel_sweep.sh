#!/bin/bash
# The cost model's testbed measurements: 2x4 and 4x2, 1 and 2 NICs per node at 500 Mbit/s each,
# flat / hierarchical / sharded, 1M-80M; three rounds, configurations taking turns in a rotating order, so a slow
# spell of this shared 2-core machine lands on one round of some configurations, not on all rounds of one.
# Then: python -m hybrid.costmodel --calibrate experiments/perf/costmodel/2x4-*-r*.json \
#         --check experiments/perf/costmodel/*-r*.json
# Needs root (the network testbed). About 16 minutes here.
set -euo pipefail
out=${1:-experiments/perf/costmodel}
rounds=${ROUNDS:-3}
mkdir -p "$out"
configs=(2x4:1 2x4:2 4x2:1 4x2:2)
for round in $(seq 1 "$rounds"); do
  # Each round starts one configuration later, so none always runs right after the same other one.
  for i in "${!configs[@]}"; do
    config=${configs[$(( (i + round - 1) % ${#configs[@]} ))]}
    layout=${config%:*} nics=${config#*:}
    python -m hybrid.bench --layout "$layout" --sizes 1M,4M,16M,40M,80M --algorithms flat,hierarchical,sharded \
      --iters 5 --warmup 1 --testbed-mbit 500 --testbed-nics "$nics" \
      --output "$out/$layout-${nics}nic-r$round.json" --overwrite
  done
done
