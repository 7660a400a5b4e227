"""The alpha-beta cost model as the report uses it: calibrated on the sweep's own hierarchical jobs (rank 0's
per-phase times), described in one line, and asked for each job's communication time per step.

A level the sweep cannot fit is refused with the reason in words (a ValueError), so the report can say why it
has no model instead of printing inf or nan.
"""

from __future__ import annotations

from hybrid.core.costmodel import Level, Model, fit_level, predict
from hybrid.core.units import human_rate
from hybrid.tools.report.job import Job, is_reference

__all__ = ["auto_choice", "calibrate_from_jobs", "describe_model", "predict_job", "predict_jobs"]


def _level_points(jobs: list[Job]) -> dict[str, list[tuple[float, float, float]]]:
    """(steps, bytes, seconds) per step of finished hierarchical jobs: per step, each bucket is one phase call."""
    points: dict[str, list[tuple[float, float, float]]] = {"intra": [], "inter": []}
    for job in jobs:
        if not job.ok or job.comm != "hierarchical":
            continue
        n, g = job.layout.nnodes, job.layout.node_sizes[0]
        buckets = job.buckets
        size = sum(buckets)
        if g > 1:
            points["intra"].append(((g - 1) * len(buckets), (g - 1) / g * size, job.phase_s("intra_reduce")))
        if n > 1:
            points["inter"].append((2 * (n - 1) * len(buckets), 2 * (n - 1) / n * size,
                                    job.phase_s("inter_allreduce")))
    return points


def _one_call_size(points: list[tuple[float, float, float]]) -> bool:
    return len({round(b / s, 3) for s, b, _ in points if s > 0}) <= 1


def calibrate_from_jobs(jobs: list[Job]) -> Model:
    """Fit both levels from finished hierarchical jobs (rank 0's intra_reduce and inter_allreduce per step);
    ValueError naming the level and why it could not be fitted."""
    levels = {}
    for name, points in _level_points(jobs).items():
        what = "more than one worker per node" if name == "intra" else "more than one node"
        if not points:
            raise ValueError(f"{name}: not fitted (no finished hierarchical job with {what})")
        if len(points) < 2 or _one_call_size(points):
            raise ValueError(f"{name}: not fitted (all {name} calls the same size: latency and bandwidth cannot "
                             f"be told apart; hierarchical jobs of other node sizes or models would separate them)")
        levels[name] = fit_level(points)
    return Model(levels["intra"], levels["inter"])


def describe_model(model: Model, jobs: list[Job] | None) -> str:
    """One line on the fitted levels, in words where a part of a level was not resolved (never inf or nan).
    ``jobs``: the sweep the model was fitted on (for the reason), or None (bench files)."""
    points = _level_points(jobs) if jobs is not None else {}

    def level(name: str, lv: Level) -> str:
        alpha = f"alpha {lv.alpha_s * 1e6:.0f} us" if lv.alpha_s > 0 else "alpha below resolution (fitted <= 0)"
        if lv.gbit_per_s is not None:
            return f"{name} {alpha}, {human_rate(lv.gbit_per_s * 1e3)}"
        pts = points.get(name)
        why = (f"all {name} calls the same size" if pts and _one_call_size(pts) else
               "the time per call did not grow with its size across the calibration runs: the least-squares "
               "per-byte cost came out <= 0")
        return f"{name}: bandwidth not fitted ({why}), priced by latency alone, {alpha}"

    source = "this sweep's hierarchical jobs (rank 0's phase times)" if jobs is not None else "the bench files"
    return f"Cost model calibrated on {source}: {level('intra', model.intra)}; {level('inter', model.inter)}."


def auto_choice(job: Job, nbytes: float) -> str:
    """The algorithm an auto job ran for buckets of about ``nbytes``: its decision for the nearest size."""
    decisions = job.metrics.get("comm_auto", {}).get("decisions", []) if job.metrics else []
    if not decisions:
        return "flat"
    return min(decisions, key=lambda d: abs(d["bytes"] - nbytes))["chosen"]


def predict_job(model: Model, job: Job) -> float | None:
    """Predicted communication seconds per step of a finished job, bucket by bucket (an auto job priced by the
    algorithm it chose for each size); None for what the model does not price."""
    if not job.ok or is_reference(job.comm) or "+" in job.comm or job.layout.world_size == 1:
        return None  # torch's own comms, and 16-bit hops, which the cost model does not price
    return sum(predict(model, auto_choice(job, b) if job.comm == "auto" else job.comm, job.layout, b)["total"]
               for b in job.buckets)


def predict_jobs(model: Model | None, jobs: list[Job]) -> list[float]:
    """Set each job's ``predicted_s`` (None without a model) and, where it ran communication, its relative
    prediction error in ``extra["error"]``; the absolute errors, for the report's median."""
    errors = []
    for job in jobs:
        job.predicted_s = predict_job(model, job) if model else None
        if job.predicted_s and job.comm_per_step_s > 0:
            job.extra["error"] = job.predicted_s / job.comm_per_step_s - 1
            errors.append(abs(job.extra["error"]))
    return errors
