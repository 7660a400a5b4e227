"""report_loss.png: every job's loss against samples seen and against wall time, and the bytes it sent per step.

The speed tables rank comms that compute the same update (flat, hierarchical, sharded and DDP train the same
weights). A sweep with comms that train differently (comm=diloco is another optimizer; a compressed hop rounds)
needs the loss beside the speed: the same loss reached sooner in wall time, or with fewer bytes, is what such a
comm buys. One row per (model, shape, network), drawn from each job's TensorBoard ``train/loss`` where it
logged at least :data:`MIN_POINTS` steps (``trainer.log_every`` small against ``trainer.max_steps``).
"""

from __future__ import annotations

from typing import Any

from hybrid.tools.report.job import Job, is_reference

__all__ = ["MIN_POINTS", "bytes_per_step", "loss_figure", "loss_points", "smoothed"]

MIN_POINTS = 10


def loss_points(job: Job) -> list[tuple[int, float, float]]:
    """(step, loss, wall time) of every logged ``train/loss`` of ``job``, in step order; [] without a log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = job.path / "tb"
    if not tb.is_dir():
        return []
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    events.Reload()
    if "train/loss" not in events.Tags()["scalars"]:
        return []
    return sorted((e.step, e.value, e.wall_time) for e in events.Scalars("train/loss"))


def bytes_per_step(job: Job) -> tuple[float | None, str]:
    """What the job put on the inter-node network per step, and how it was counted: the busiest node's NICs
    (testbed), else rank 0's own counters of the phases that cross nodes (inter_allreduce, flat_allreduce);
    None for torch's comms off the testbed (they have no counters)."""
    metrics = job.metrics or {}
    if metrics.get("nic_tx_bytes_per_step") is not None:
        return float(metrics["nic_tx_bytes_per_step"]), "NIC bytes per step (busiest node)"
    if is_reference(job.comm):
        return None, "rank 0's bytes across nodes per step"
    sent = sum(metrics.get("bytes", {}).get(p, 0) for p in ("inter_allreduce", "flat_allreduce"))
    return sent / job.steps, "rank 0's bytes across nodes per step"


def smoothed(values: list[float], window: int) -> list[float]:
    """Each value as the mean of it and the ``window`` - 1 before it (one batch's loss is noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def loss_figure(jobs: list[Job]) -> Any | None:
    """The figure, or None where no job logged enough steps to draw a curve."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    curves = {id(j): points for j in jobs if j.ok and len(points := loss_points(j)) >= MIN_POINTS}
    drawn = [j for j in jobs if id(j) in curves]
    if not drawn:
        return None
    rows = sorted({(j.model, j.layout, j.network) for j in drawn}, key=lambda r: (r[0], r[1].world_size, r[2]))
    comms = sorted({j.comm for j in drawn}, key=lambda c: (is_reference(c), c))
    color = {c: colormaps["tab10"].colors[k % 10] for k, c in enumerate(comms)}
    fig = Figure(figsize=(16, 4.2 * len(rows)))
    axes = fig.subplots(len(rows), 3, squeeze=False)
    for (model, layout, network), (by_samples, by_time, sent) in zip(rows, axes):
        here = [j for j in drawn if (j.model, j.layout, j.network) == (model, layout, network)]
        for job in here:
            points = curves[id(job)]
            per_step = float(job.metrics["samples_per_step"])
            start = points[0][2]
            window = max(1, len(points) // 30)
            losses = smoothed([loss for _, loss, _ in points], window)
            by_samples.plot([s * per_step for s, _, _ in points], losses, label=job.comm, color=color[job.comm],
                            linewidth=0.8)
            by_time.plot([t - start for _, _, t in points], losses, label=job.comm, color=color[job.comm],
                         linewidth=0.8)
        sizes = [bytes_per_step(j) for j in here]
        sent.bar(range(len(here)), [0.0 if b is None else b / 1e6 for b, _ in sizes],
                 color=[color[j.comm] for j in here])
        sent.set_xticks(range(len(here)), [j.comm + (" (no counts)" if b is None else "") for j, (b, _) in
                                           zip(here, sizes)], rotation=30, ha="right", fontsize=8)
        sent.set(ylabel="MB per step", title=sizes[0][1] if len({w for _, w in sizes}) == 1 else "MB per step")
        sent.set_ylim(bottom=0)
        by_samples.set(xlabel="samples seen", ylabel="train loss (rank 0's batch, running mean)",
                       title=f"{model}, {layout}, {network}")
        by_time.set(xlabel="wall time since the first logged step (s)", title="the same against wall time")
        by_samples.legend(fontsize=8)
    fig.tight_layout()
    return fig
