"""report.png: per model size, step time (top) and communication time per step (bottom) of every comm against
cluster shape, so the trend over shapes shows at a glance where the tables give single numbers.
"""

from __future__ import annotations

import math
from typing import Any

from hybrid.core.topology import Layout
from hybrid.tools.report.breakdown import exposed_s
from hybrid.tools.report.job import Job, is_reference

__all__ = ["report_figure"]


def report_figure(jobs: list[Job]) -> Any:
    """report.png's matplotlib Figure: per model size, step time of every comm (top) and communication time per
    step (bottom) against cluster shape; every y axis from 0; the network in the title.

    The communication panel draws two measures, never mixed in one line: solid, rank 0's time inside the
    phase calls (hybrid's comms: their counters); dashed, the communication the step waited for (exposed:
    the breakdown's phases and comm_wait outside them, mean over ranks), for every comm whose metrics hold
    per-rank accounts. torch's own comms (ddp, hsdp) have no phase counters, so they appear dashed only;
    where they ran without accounts (older runs), a note in the panel says they are not drawn.
    """
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    models = sorted({j.model for j in jobs if j.ok}) or ["(no finished jobs)"]
    comms = sorted({j.comm for j in jobs if j.ok}, key=lambda c: (is_reference(c), c))
    color = {c: colormaps["tab10"].colors[k % 10] for k, c in enumerate(comms)}
    fig = Figure(figsize=(6 * len(models), 7.5))
    axes = fig.subplots(2, len(models), squeeze=False)
    for col, model_name in enumerate(models):
        done = [j for j in jobs if j.ok and j.model == model_name]
        shapes = sorted({j.layout for j in done}, key=lambda shape: (shape.world_size, shape.nnodes))
        step_ax, comm_ax = axes[0][col], axes[1][col]
        undrawn = []
        for comm in comms:
            mine = [j for j in done if j.comm == comm]
            _line(step_ax, shapes, [(j.layout, j.step_s) for j in mine], comm, color[comm], exposed=False)
            if not is_reference(comm):
                _line(comm_ax, shapes, [(j.layout, j.comm_per_step_s) for j in mine], f"{comm}, in calls",
                      color[comm], exposed=False)
            exposed = [(j.layout, e) for j in mine if (e := exposed_s(j.metrics)) is not None]
            label = f"{comm}, exposed" + (" (no phase counters)" if is_reference(comm) else "")
            _line(comm_ax, shapes, exposed, label, color[comm], exposed=True)
            missing = [str(j.layout) for j in mine if is_reference(comm) and exposed_s(j.metrics) is None]
            if missing:
                undrawn.append(f"{comm} at {', '.join(missing)}")
        if undrawn:
            comm_ax.set_ylim(0, comm_ax.get_ylim()[1] * 1.12)  # headroom for the note above the lines
            comm_ax.text(0.02, 0.97, f"{'; '.join(undrawn)}: no phase counters and no per-rank accounts: not drawn",
                         transform=comm_ax.transAxes, va="top", fontsize=7)
        comm_note = "\nsolid: in phase calls (rank 0); dashed: exposed (waited on)"
        for ax, label, note in ((step_ax, "step time", ""), (comm_ax, "communication time", comm_note)):
            ax.set_xticks(range(len(shapes)), [str(s) for s in shapes])
            ax.set_xlabel("cluster shape (nodes x workers)")
            ax.set_ylabel(f"{label}, ms per step")
            ax.set_title(f"{model_name}: {label}{note}", fontsize=9)
            ax.set_ylim(bottom=0)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle("; ".join(sorted({j.network for j in jobs})), fontsize=11)
    fig.tight_layout()
    return fig


def _line(ax: Any, shapes: list[Layout], points: list[tuple[Layout, float]], label: str, color: Any,
          exposed: bool) -> None:
    """One comm's points against shape, in ms; exposed ones dashed and hollow (told apart on a single shape too)."""
    points = sorted((shapes.index(shape), value * 1e3) for shape, value in points if math.isfinite(value))
    if points:
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="s" if exposed else "o", linestyle="--" if exposed else "-", color=color,
                markerfacecolor="none" if exposed else color, label=label)
