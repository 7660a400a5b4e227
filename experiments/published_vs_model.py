"""The cost model against published all-reduce measurements: one row per measurement.

Every row uses only what its source states (nodes, GPUs per node, NICs and their line rate, the algorithm,
the message size; sources in experiments/published_measurements.md), the NIC at its line rate and 5 us per
inter-node step: no per-row fitting. NCCL's ring stripes its channels over the NICs next to the node's GPUs,
so flat runs over min(GPUs per node, NICs) rails (``flat_channels``); on two nodes NCCL's tree sends S across
each NIC (``two_node_tree``). Error = predicted / published - 1, on the figure the source gives (a time, a
bus bandwidth or a ratio). Run: ``python experiments/published_vs_model.py`` (prints the Markdown table of
experiments/RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid.core.costmodel import Level, Model, predict
from hybrid.core.topology import Layout

INTER_ALPHA_US = 5.0
INTRA = Level.from_bandwidth(2.0, 1200.0)  # NVLink-class; flat rows do not depend on it (their ring waits on the NIC)


@dataclass(frozen=True)
class Row:
    source: str
    hardware: str
    layout: str
    nics: int
    nic_gbps: float
    nbytes: float
    figure: str  # "time", "busbw" or "ratio"
    published: float  # seconds, GB/s, or a ratio of times
    algorithm: str  # flat | flat-tree | hierarchical | sharded | ratio "a/b"
    lacks: str = ""  # where the row misses: the mechanism the model does not have


ROWS = [
    Row("nccl-tests #119", "3 x 8 A100, 4 x 200G HDR IB", "3x8", 4, 200, 133169160, "time", 2666.0e-6, "flat"),
    Row("nccl #1368", "5 x 8 H100, 4 x 400G RoCE", "5x8", 4, 400, 1e9, "busbw", 190.0, "flat"),
    Row("nccl-tests #309", "4 x 8 H100/H200 HGX, 8 x 400G IB", "4x8", 8, 400, 8e9, "busbw", 365.84, "flat"),
    Row("nccl #307 / nccl-tests #29", "n x 8 V100 DGX-1 (n = 8 taken), 4 x 100G EDR IB", "8x8", 4, 100, 1e9, "busbw", 47.0, "flat"),
    Row("nccl #569 (config A)", "8 x 1 V100 DGX-2, 1 NIC of 100G EDR per GPU", "8x1", 1, 100, 1.6e9, "time", 0.363, "flat",
        "NCCL 2021 on DGX-2 moved 62% of line rate per NIC; the model prices NICs at line rate"),
    Row("nccl #569 (config B)", "4 x 2 V100 DGX-2, 2 x 100G EDR", "4x2", 2, 100, 1.6e9, "time", 0.173, "flat",
        "as config A: per-NIC efficiency"),
    Row("nccl #569 (config C)", "2 x 4 V100 DGX-2, 4 x 100G EDR", "2x4", 4, 100, 1.6e9, "time", 0.132, "flat",
        "per-NIC efficiency; and config C scales less than 1/NICs (2.75x for 4x the NICs): an intra-node or "
        "PCIe limit the model does not have"),
    Row("nccl-tests #22 (ring)", "2 x 8 V100 p3dn, 1 x 100G EFA", "2x8", 1, 100, 1e9, "time", 0.268, "flat",
        "EFA in 2019 reached 50-80 Gb/s (the maintainer's figures), not 100: per-NIC efficiency"),
    Row("nccl-tests #22 (tree)", "2 x 8 V100 p3dn, 1 x 100G EFA", "2x8", 1, 100, 1e9, "time", 0.134, "flat-tree",
        "as the ring row: per-NIC efficiency"),
    Row("nccl-tests #22 (ring / tree)", "2 x 8 V100 p3dn, 1 x 100G EFA", "2x8", 1, 100, 1e9, "ratio", 0.268 / 0.134,
        "flat/flat-tree"),
    Row("nccl #527 (3 nodes)", "3 x 8 A100 p4dn, 4 x 100G EFA", "3x8", 4, 100, 2**30, "busbw", 31.77, "flat",
        "EFA with NCCL 2.9.9 in 2022 at 64% of line rate: per-NIC efficiency"),
    Row("nccl #527 (4 nodes)", "4 x 8 A100 p4dn, 4 x 100G EFA", "4x8", 4, 100, 2**30, "busbw", 29.61, "flat",
        "as 3 nodes"),
    Row("horovod PR #3608 (ring / torus)", "32 x 6 V100, 1 x 10GbE", "32x6", 1, 10, 1.36e9, "ratio", 2498 / 978,
        "flat/sharded",
        "one TCP stream per ring does not fill a 10 GbE NIC; six torus groups open six: a per-connection cap "
        "(--conn-gbps) the source does not state (4 Gbit/s per connection gives 2.55x)"),
]


def _model(row: Row, tree: bool = False) -> Model:
    g = Layout.parse(row.layout).node_sizes[0]
    return Model(INTRA, Level.from_bandwidth(INTER_ALPHA_US, row.nic_gbps), nics_per_node=row.nics,
                 flat_channels=min(g, row.nics), two_node_tree=tree)


def _seconds(row: Row, algorithm: str) -> float:
    tree = algorithm == "flat-tree"
    return predict(_model(row, tree), "flat" if tree else algorithm, Layout.parse(row.layout), row.nbytes)["total"]


def predicted(row: Row) -> float:
    """The model's figure in the row's own unit."""
    if row.figure == "ratio":
        a, b = row.algorithm.split("/")
        return _seconds(row, a) / _seconds(row, b)
    seconds = _seconds(row, row.algorithm)
    if row.figure == "time":
        return seconds
    world = Layout.parse(row.layout).world_size
    return row.nbytes / seconds / 1e9 * 2 * (world - 1) / world


def _unit(row: Row, value: float) -> str:
    return {"time": f"{value * 1e3:.1f} ms", "busbw": f"{value:.1f} GB/s busbw", "ratio": f"{value:.2f}x"}[row.figure]


def table() -> str:
    lines = ["| source | hardware (stated) | size | algorithm | published | model | error | where it misses |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    errors = []
    for row in ROWS:
        model = predicted(row)
        # Error on the time: busbw is inversely proportional to it, so compare published / model there.
        error = row.published / model - 1 if row.figure == "busbw" else model / row.published - 1
        errors.append(abs(error))
        lines.append(f"| {row.source} | {row.hardware} | {row.nbytes / 1e6:,.0f} MB | {row.algorithm} | "
                     f"{_unit(row, row.published)} | {_unit(row, model)} | {error:+.0%} | "
                     f"{row.lacks if abs(error) > 0.25 else ''} |")
    within = sum(e <= 0.25 for e in errors)
    lines.append("")
    lines.append(f"{within} of {len(ROWS)} rows within 25% (error on the time: predicted / published - 1; for a "
                 "bus bandwidth, published / predicted - 1).")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
