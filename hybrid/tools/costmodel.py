"""The cost model's command line: predictions for a layout, or a model calibrated from benchmark results."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hybrid.core import costmodel
from hybrid.core.costmodel import MODELLED_ALGORITHMS, Level, Model, bench_chunk_bytes, calibrate, predict, predict_all
from hybrid.core.topology import Layout
from hybrid.core.units import human_size, parse_size

__all__ = ["check", "main", "predictions", "as_benched"]


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
    p.add_argument("--overlap", type=float, default=None,
                   help="share of the lesser level a pipeline hides, 0..1 (default 1, or fitted by --calibrate)")
    p.add_argument("--json", action="store_true", help="print JSON: per size and algorithm, seconds, algbw, busbw")
    p.add_argument("--calibrate", nargs="+", metavar="BENCH_JSON", help="fit both levels from hybrid.bench results")
    p.add_argument("--check", nargs="+", metavar="BENCH_JSON",
                   help="compare the model with hybrid.bench results (their layout, NICs and pipeline pieces): "
                        "per row measured, predicted and error, the median of repeated runs of one configuration")
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


def as_benched(model: Model, report: dict[str, Any], nbytes: int) -> Model:
    """``model`` as ``hybrid.bench`` ran on gloo in ``report``: its NICs per node, and the leader's pipeline
    pieces in flight (up to ``PIPELINE_WINDOW``) each on a NIC of its own, gloo taking a group's NICs in turn."""
    from hybrid.core.comm.base import PIPELINE_WINDOW  # imports torch: only when checking

    nics = int(report.get("testbed_nics_per_node", 1))
    chunk = bench_chunk_bytes(report)
    pieces = max(1, math.ceil(nbytes / chunk)) if chunk else 1
    return replace(model, nics_per_node=nics, flat_channels=1, leader_nics=max(1, min(nics, PIPELINE_WINDOW, pieces)))


def check(model: Model, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every multi-node row of ``reports`` against the model's prediction (pipelined as the bench ran it).

    Rows of one configuration (layout, NICs, algorithm, size) from repeated runs count once, at the median
    of their medians. Errors are predicted / measured - 1."""
    measured: dict[tuple, list[float]] = {}
    context: dict[tuple, tuple[dict[str, Any], Layout]] = {}
    for report in reports:
        layout = Layout(tuple(report["node_sizes"]))
        if layout.nnodes < 2:
            continue
        for row in report["results"]:
            if row["runs_as"] not in MODELLED_ALGORITHMS:
                continue
            key = (str(layout), int(report.get("testbed_nics_per_node", 1)), row["runs_as"], row["bytes"])
            measured.setdefault(key, []).append(row["median_s"])
            context[key] = (report, layout)
    rows = []
    for key in sorted(measured):
        layout_name, nics, algorithm, nbytes = key
        report, layout = context[key]
        seconds = statistics.median(measured[key])
        predicted = predict(as_benched(model, report, nbytes), algorithm, layout, nbytes,
                            bench_chunk_bytes(report))["total"]
        rows.append({"layout": layout_name, "nics_per_node": nics, "algorithm": algorithm, "bytes": nbytes,
                     "runs": len(measured[key]), "measured_s": seconds, "predicted_s": predicted,
                     "error": predicted / seconds - 1})
    if not rows:
        raise ValueError("--check: no multi-node flat, hierarchical or sharded rows in these reports")
    errors = [abs(r["error"]) for r in rows]
    return {"model": asdict(model), "rows": rows,
            "median_abs_error": statistics.median(errors), "worst_abs_error": max(errors)}


def _print_check(result: dict[str, Any]) -> None:
    print(f"{'layout':>7} {'NICs':>4} {'algorithm':>13} {'size':>6} {'runs':>4} {'measured ms':>11} "
          f"{'model ms':>9} {'error':>7}")
    for r in result["rows"]:
        print(f"{r['layout']:>7} {r['nics_per_node']:>4} {r['algorithm']:>13} {human_size(r['bytes']):>6} "
              f"{r['runs']:>4} {r['measured_s'] * 1e3:11.1f} {r['predicted_s'] * 1e3:9.1f} {r['error']:+7.1%}")
    print(f"{len(result['rows'])} rows: median |error| {result['median_abs_error']:.1%}, "
          f"worst {result['worst_abs_error']:.1%}")


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
                        flat_channels=args.flat_channels or model.nics_per_node, two_node_tree=args.two_node_tree,
                        overlap=model.overlap if args.overlap is None else args.overlap)
        checked = check(model, [json.loads(Path(f).read_text()) for f in args.check]) if args.check else None
    except (ValueError, OSError, KeyError) as exc:
        print(f"{p.prog}: error: {exc}", file=sys.stderr)  # one line: the bad value, not the usage
        return 2
    if checked is not None:
        if args.json:
            print(json.dumps(checked, indent=2))
        else:
            print(f"model {json.dumps(asdict(model))}")
            _print_check(checked)
        return 0
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

