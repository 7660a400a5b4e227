"""Where a step's time goes, per algorithm: the report's stacked bars and their table.

From each job's per-rank accounting (metrics.json ``ranks``: medians per rank
of the loop's parts, each phase and each phase's part not hidden behind
backward), averaged over the ranks: compute (data, forward, backward up to
the last gradient, optimizer), then each phase's exposed time, then
``comm_wait`` that no phase accounts for (all of it under ``ddp``, whose
all-reduce has no phase counters), then the rest of the step (the loop's own
overhead). A phase hidden behind backward costs nothing here; that is the
point of the picture.

"Exposed" is not the report's other phase figure, rank 0's time inside a
phase's calls: a leader's intra_broadcast returns once it has sent, while
the other ranks of its node wait in theirs for the leaders' all-reduce, so the
same phase can be 0.2 ms in call on rank 0 and 140 ms exposed on average.
Both tables name their measure in every phase column and say it under the table.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Protocol

from hybrid.core.costmodel import PHASES

__all__ = ["SEGMENT_LABELS", "breakdown", "breakdown_figure", "breakdown_table", "exposed_s", "plot_breakdown"]

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


def exposed_s(metrics: dict[str, Any] | None) -> float | None:
    """Seconds of a median step spent waiting on communication (the exposed phases and comm_wait outside
    them, mean over ranks), or None without accounts: the one communication measure every comm has, torch's
    own DDP included."""
    parts = breakdown(metrics) if metrics else None
    return None if parts is None else sum(v for k, v in parts.items() if k not in ("compute", "other"))


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
    """Markdown: one row per job with accounts, ms per segment, each phase column named as exposed time."""
    groups = _groups(jobs)
    if not groups:
        return []
    headers = ["compute ms", *(f"{p} exposed ms (waited on by the step)" for p in PHASES), "comm_wait ms, no phase",
               "other ms"]
    lines = ["## Where a step's time goes (ms, median step, mean over ranks)", "",
             "| model | shape | comm | " + " | ".join(headers) + " |", "|" + " --- |" * (3 + len(SEGMENT_LABELS))]
    for (model, shape), rows in groups.items():
        for comm, parts in rows:
            lines.append(f"| {model} | {shape} | {comm} | " + " | ".join(f"{parts[s] * 1e3:.1f}" for s in SEGMENT_LABELS)
                         + " |")
    return [*lines, "", "Exposed: the part of a phase the training step waited for after backward (mean over ranks); "
                        "a phase hidden behind backward counts 0 here, and a non-leader's wait for the leaders' "
                        "all-reduce counts in its intra_broadcast, so these are not the phase table's times in call.",
            ""]


def breakdown_figure(jobs: list[_Job], title: str | None = None) -> Any:
    """report_breakdown.png's matplotlib Figure: stacked bars, one panel per model and shape, one bar per comm,
    all panels on one y scale from 0 and one legend for the figure; None without accounts."""
    groups = _groups(jobs)
    if not groups:
        return None
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    width = max(len(r) for r in groups.values())
    fig = Figure(figsize=(2.5 + 1.1 * width * len(groups), 5.0), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False, sharey=True)[0]
    colors = colormaps["tab10"].colors
    for ax, ((model, shape), rows) in zip(axes, groups.items()):
        bottoms = [0.0] * len(rows)
        for k, label in enumerate(SEGMENT_LABELS):
            heights = [parts[label] * 1e3 for _, parts in rows]
            ax.bar(range(len(rows)), heights, bottom=bottoms, color=colors[k % len(colors)], label=label)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_xticks(range(len(rows)), [comm for comm, _ in rows], rotation=30)
        ax.set_title(f"{model}, {shape}", fontsize=9)
    axes[0].set_ylabel("ms per step (median step, mean over ranks)")
    axes[0].set_ylim(bottom=0)  # shared: every panel
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right upper", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_breakdown(jobs: list[_Job], out_png: Path, title: str | None = None) -> bool:
    """Write :func:`breakdown_figure` to ``out_png``; False (nothing written) without accounts."""
    fig = breakdown_figure(jobs, title)
    if fig is not None:
        fig.savefig(out_png, dpi=90)
    return fig is not None
