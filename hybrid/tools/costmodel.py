"""The cost model's command line: predictions for a layout, or a model calibrated from benchmark results."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hybrid.core import costmodel
from hybrid.core.costmodel import MODELLED_ALGORITHMS, Level, Model, calibrate, predict, predict_all
from hybrid.core.topology import Layout
from hybrid.tools.units import human_size, parse_size

__all__ = ["main", "predictions"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid.costmodel", description=costmodel.__doc__.split("\n\n")[0])
    p.add_argument("--layout", default="1024x8", help="NNODESxNPROC (default 1024x8)")
    p.add_argument("--sizes", default="25M,100M,1G", help="message sizes, bytes or K/M/G (default 25M,100M,1G)")
    p.add_argument("--intra-gbps", type=float, default=3600.0, help="intra-node Gbit/s (default 3600: NVLink-class)")
    p.add_argument("--intra-alpha-us", type=float, default=2.0, help="intra-node latency per step, us (default 2)")
    p.add_argument("--inter-gbps", type=float, default=400.0, help="inter-node Gbit/s per NIC (default 400)")
    p.add_argument("--inter-alpha-us", type=float, default=5.0, help="inter-node latency per step, us (default 5)")
    p.add_argument("--nics-per-node", type=int, default=1, help="NICs per node (default 1)")
    p.add_argument("--conn-gbps", type=float, default=None,
                   help="the most one connection carries, Gbit/s (default: a connection fills its NIC)")
    p.add_argument("--flat-channels", type=int, default=None,
                   help="connections flat's ring runs side by side over the NICs (default: --nics-per-node, as "
                        "NCCL stripes its channels; 1 for gloo)")
    p.add_argument("--leader-nics", type=int, default=1, help="NICs hierarchical's leader spreads over (default 1)")
    p.add_argument("--two-node-tree", action="store_true", help="flat on 2 nodes as NCCL's tree (S per NIC)")
    p.add_argument("--json", action="store_true", help="print JSON: per size and algorithm, seconds, algbw, busbw")
    p.add_argument("--calibrate", nargs="+", metavar="BENCH_JSON", help="fit both levels from hybrid.tools.bench results")
    return p


def predictions(model: Model, layout: Layout, sizes: list[int]) -> dict[str, Any]:
    """Per size and algorithm: predicted seconds (and per phase), algbw = bytes / seconds and busbw = algbw x
    2(N-1)/N in GB/s, as nccl-tests reports them for an all-reduce of N ranks."""
    world = layout.world_size
    rows = []
    for size in sizes:
        for algorithm in MODELLED_ALGORITHMS:
            phases = predict(model, algorithm, layout, size)
            seconds = phases.pop("total")
            algbw = size / seconds / 1e9 if seconds > 0 else float("inf")
            rows.append({"bytes": size, "algorithm": algorithm, "seconds": seconds, "phases_s": phases,
                         "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (world - 1) / world})
    return {"layout": str(layout), "world_size": world, "model": asdict(model), "predictions": rows}


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        layout = Layout.parse(args.layout)
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
        if args.calibrate:
            model = calibrate([json.loads(Path(f).read_text()) for f in args.calibrate], args.nics_per_node)
        else:
            if min(args.intra_gbps, args.inter_gbps) <= 0 or min(args.intra_alpha_us, args.inter_alpha_us) < 0:
                raise ValueError("bandwidths must be > 0 and latencies >= 0")
            model = Model(Level.from_bandwidth(args.intra_alpha_us, args.intra_gbps),
                          Level.from_bandwidth(args.inter_alpha_us, args.inter_gbps), args.nics_per_node)
        model = replace(model, conn_gbps=args.conn_gbps, leader_nics=args.leader_nics,
                        flat_channels=args.flat_channels or model.nics_per_node, two_node_tree=args.two_node_tree)
    except (ValueError, OSError, KeyError) as exc:
        p.error(str(exc))
    if args.json:
        print(json.dumps(predictions(model, layout, sizes), indent=2))
        return 0
    print(f"layout {layout} (world {layout.world_size}); model {json.dumps(asdict(model))}")
    print(f"{'size':>8} {'flat ms':>12} {'hierarchical ms':>16} {'sharded ms':>12} {'best':>13} {'flat/best':>9}")
    for size in sizes:
        t = predict_all(model, layout, size)
        best = min(t, key=t.get)
        print(f"{human_size(size):>8} {t['flat'] * 1e3:12.3f} {t['hierarchical'] * 1e3:16.3f} "
              f"{t['sharded'] * 1e3:12.3f} {best:>13} {t['flat'] / t[best]:9.2f}")
    return 0

