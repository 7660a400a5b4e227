#!/usr/bin/env bash
# The trainer's final parameter checksum (metrics.json param_checksum) for five runs that cover its paths:
# hierarchical, sharded with the bf16 inter-node hop, flat, plain DDP and thread mode (2x2, 50 steps each).
# Run it at two commits and compare the output: equal lines mean the change left training bit for bit alone.
#
#   experiments/trainer_checksums.sh /tmp/checksums-before > before.txt
set -euo pipefail
out=${1:?usage: $0 OUTPUT_DIR}
mkdir -p "$out"
i=0
for args in "comm=hierarchical" "comm=sharded comm.inter_compression=bf16" "comm=flat" "comm=ddp" \
            "cluster.intra_mode=thread"; do
  i=$((i + 1))
  # shellcheck disable=SC2086  # the overrides are words
  python -m hybrid.train $args "hydra.run.dir=$out/run$i" "data.root=$out/data" > "$out/log$i" 2>&1
  echo "$args $(python -c "import json, sys; print(json.load(open(sys.argv[1]))['param_checksum'])" "$out/run$i/metrics.json")"
done
