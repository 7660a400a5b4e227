"""docs/sweeps-and-report.md's "When does hierarchy pay?": the cost model's speed-up of hierarchical and sharded over flat.

Panels 1-3: 16 nodes, 100 MB of gradients, NVLink-class intra level (3600 Gbit/s, 2 us), NICs at 10, 100 and
400 Gbit/s (5 us per step), against NICs per node, for 4 and 8 workers per node. Flat is NCCL's ring: its
channels striped over min(workers, NICs) NICs; hierarchical's leader uses one NIC; sharded's g groups
min(g, NICs). Panel 4: this machine's testbed (2x4 and 4x2, 500 Mbit/s NICs, 80 MB, gloo: flat on one NIC per
call, the model calibrated on the 2x4 runs) with the measured speed-ups as markers.

Run: ``python experiments/when_hierarchy_pays.py`` (writes experiments/when_hierarchy_pays.png; panel 4 reads
experiments/perf/costmodel/*.json from ``experiments/costmodel_sweep.sh``).
"""

from __future__ import annotations

import glob
import json
import statistics
from pathlib import Path

from hybrid.core.costmodel import Level, Model, bench_chunk_bytes, calibrate, predict
from hybrid.core.topology import Layout
from hybrid.tools.costmodel import as_benched

HERE = Path(__file__).parent
NICS = [1, 2, 4, 8]
SIZE = 100e6


def speedups(link_gbps: float, g: int, nics: int, nnodes: int = 16) -> dict[str, float]:
    model = Model(Level.from_bandwidth(2, 3600), Level.from_bandwidth(5, link_gbps), nics_per_node=nics,
                  flat_channels=min(g, nics))
    layout = Layout.parse(f"{nnodes}x{g}")
    flat = predict(model, "flat", layout, SIZE)["total"]
    return {alg: flat / predict(model, alg, layout, SIZE)["total"] for alg in ("hierarchical", "sharded")}


def _testbed_panel(ax) -> None:
    files = sorted(glob.glob(str(HERE / "perf" / "costmodel" / "*.json")))
    reports = [json.loads(Path(f).read_text()) for f in files]
    base = [r for r in reports if r["layout"] == "2x4"]
    if not base:
        ax.set_title("testbed: run experiments/costmodel_sweep.sh")
        return
    model = calibrate(base)
    size = 80 * 2**20
    for layout_name, marker in (("2x4", "o"), ("4x2", "s")):
        layout = Layout.parse(layout_name)
        for alg, color in (("hierarchical", "C0"), ("sharded", "C1")):
            predicted, measured = [], []
            for k in (1, 2):
                runs = [r for r in reports if r["layout"] == layout_name and r.get("testbed_nics_per_node", 1) == k]
                if not runs:
                    continue
                m = as_benched(model, runs[0], size)
                chunk = bench_chunk_bytes(runs[0])
                predicted.append(predict(m, "flat", layout, size, chunk)["total"]
                                 / predict(m, alg, layout, size, chunk)["total"])
                times = {a: statistics.median(row["median_s"] for r in runs for row in r["results"]
                                              if row["algorithm"] == a and row["bytes"] == size)
                         for a in ("flat", alg)}
                measured.append(times["flat"] / times[alg])
            ks = [1, 2][:len(predicted)]
            ax.plot(ks, predicted, color=color, linestyle="-" if layout_name == "2x4" else "--",
                    label=f"{alg} {layout_name} (model)")
            ax.plot(ks, measured, color=color, marker=marker, linestyle="none", label=f"{alg} {layout_name} (measured)")
    ax.set_title("testbed: 500 Mbit/s NICs, 80 MB, gloo")
    ax.set_xticks([1, 2])
    ax.set_xlabel("NICs per node")
    ax.legend(fontsize=6)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, link in zip(axes, (10, 100, 400)):
        for g, style in ((4, "--"), (8, "-")):
            rows = [speedups(link, g, k) for k in NICS]
            for alg, color in (("hierarchical", "C0"), ("sharded", "C1")):
                ax.plot(NICS, [r[alg] for r in rows], color=color, linestyle=style, marker=".",
                        label=f"{alg}, {g} workers/node")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(NICS, [str(k) for k in NICS])
        ax.set_xlabel("NICs per node")
        ax.set_title(f"16 nodes, {link} Gbit/s NICs, 100 MB")
    axes[0].set_ylabel("speed-up over flat (model)")
    axes[0].legend(fontsize=7)
    _testbed_panel(axes[3])
    fig.tight_layout()
    out = HERE / "when_hierarchy_pays.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    for link in (10, 100, 400):
        for g in (4, 8):
            print(f"{link:>4} Gbit/s, {g} workers/node: " + "  ".join(
                f"{k} NIC(s): hier {speedups(link, g, k)['hierarchical']:.2f}x sharded {speedups(link, g, k)['sharded']:.2f}x"
                for k in NICS))


if __name__ == "__main__":
    main()
