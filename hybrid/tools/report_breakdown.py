"""Where a step's time goes, per algorithm: the report's stacked bars and their table.

From each job's per-rank accounting (metrics.json ``ranks``: medians per rank
of the loop's parts, each phase and each phase's part not hidden behind
backward), averaged over the ranks: compute (data, forward, backward up to
the last gradient, optimizer), then each phase's exposed time, then
``comm_wait`` that no phase accounts for (all of it under ``ddp``, whose
all-reduce has no phase counters), then the rest of the step (the loop's own
overhead). A phase hidden behind backward costs nothing here; that is the
point of the picture.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Protocol

from hybrid.core.comm import PHASES

__all__ = ["SEGMENT_LABELS", "breakdown", "breakdown_table", "plot_breakdown"]

SEGMENT_LABELS = ("compute", *(f"{p} (exposed)" for p in PHASES), "comm_wait, no phase", "other")
_COMMS = ("ddp", "flat", "hierarchical", "sharded", "auto")


class _Job(Protocol):
    comm: str
    layout: Any
    model: str
    metrics: dict[str, Any] | None


def breakdown(metrics: dict[str, Any]) -> dict[str, float] | None:
    """Seconds per :data:`SEGMENT_LABELS` of one job's median step (mean over ranks), or None without accounts."""
    ranks = metrics.get("ranks")
    if not ranks:
        return None

    def mean(get: Any) -> float:
        return statistics.fmean(get(r) for r in ranks)

    compute = mean(lambda r: r["compute_s"])
    exposed = {p: mean(lambda r, p=p: r["exposed_s"].get(p, 0.0)) for p in PHASES}
    wait = mean(lambda r: r["comm_wait_s"])
    unphased = max(0.0, wait - sum(exposed.values()))
    other = max(0.0, mean(lambda r: r["step_s"]) - compute - sum(exposed.values()) - unphased)
    return dict(zip(SEGMENT_LABELS, (compute, *exposed.values(), unphased, other)))


def _groups(jobs: list[_Job]) -> dict[tuple[str, Any], list[tuple[str, dict[str, float]]]]:
    """(model, shape) -> [(comm, breakdown)] in a fixed comm order, for jobs that have accounts."""
    out: dict[tuple[str, Any], list[tuple[str, dict[str, float]]]] = {}
    for job in sorted(jobs, key=lambda j: (j.model, j.layout.world_size, j.layout.nnodes,
                                           _COMMS.index(j.comm) if j.comm in _COMMS else 99)):
        parts = breakdown(job.metrics) if job.metrics else None
        if parts is not None:
            out.setdefault((job.model, job.layout), []).append((job.comm, parts))
    return out


def breakdown_table(jobs: list[_Job]) -> list[str]:
    """Markdown: one row per job with accounts, ms per segment."""
    groups = _groups(jobs)
    if not groups:
        return []
    lines = ["## Where a step's time goes (ms, median step, mean over ranks; a phase counts only where it is not "
             "hidden behind backward)", "", "| model | shape | comm | " + " | ".join(SEGMENT_LABELS) + " |",
             "|" + " --- |" * (3 + len(SEGMENT_LABELS))]
    for (model, shape), rows in groups.items():
        for comm, parts in rows:
            lines.append(f"| {model} | {shape} | {comm} | " + " | ".join(f"{parts[s] * 1e3:.1f}" for s in SEGMENT_LABELS)
                         + " |")
    return [*lines, ""]


def plot_breakdown(jobs: list[_Job], out_png: Path) -> bool:
    """Stacked bars, one panel per model and shape, one bar per comm; False (nothing written) without accounts."""
    groups = _groups(jobs)
    if not groups:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 + 1.1 * max(len(r) for r in groups.values()) * len(groups),
                                                      4.5), squeeze=False)
    colors = plt.get_cmap("tab10").colors
    for ax, ((model, shape), rows) in zip(axes[0], groups.items()):
        bottoms = [0.0] * len(rows)
        for k, label in enumerate(SEGMENT_LABELS):
            heights = [parts[label] * 1e3 for _, parts in rows]
            ax.bar(range(len(rows)), heights, bottom=bottoms, color=colors[k % len(colors)], label=label)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_xticks(range(len(rows)), [comm for comm, _ in rows], rotation=30)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{model}, {shape}", fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return True
