"""Where the calibrated cost model says a headline's answer would flip: the link rate, and the gradient size,
at which the winner's and the other comm's predicted communication per step meet.

Said only where the model prices both comms and reproduces the measured order; otherwise one sentence says why
there is no crossing point, so a reader never takes a silent gap for "it never flips".
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from hybrid.core.costmodel import MODELLED_ALGORITHMS, Level, Model, predict
from hybrid.core.topology import Layout
from hybrid.core.units import human_bytes, human_rate
from hybrid.tools.report.format import ms
from hybrid.tools.report.job import Job, split_buckets

__all__ = ["flip_sentence"]


def _comm_per_step(model: Model, algorithm: str, layout: Layout, total: float, bucket_mb: float) -> float:
    """Predicted communication seconds per step of ``algorithm`` for ``total`` gradient bytes in DDP buckets."""
    full, rest = split_buckets(total, bucket_mb)
    cost = full * predict(model, algorithm, layout, bucket_mb * 2**20)["total"] if full else 0.0
    return cost + (predict(model, algorithm, layout, rest)["total"] if rest else 0.0)


def _crossing(diff: Callable[[float], float], lo: float, hi: float, near: float) -> tuple[float, bool] | None:
    """The x in [lo, hi] where ``diff`` changes sign nearest ``near`` (log scale), by bisection, and whether
    diff is negative below it; None where it keeps one sign over the range."""
    xs = [lo * (hi / lo) ** (k / 240) for k in range(241)]
    signs = [diff(x) < 0 for x in xs]
    brackets = [(xs[k], xs[k + 1], signs[k]) for k in range(240) if signs[k] != signs[k + 1]]
    if not brackets:
        return None
    a, b, below = min(brackets, key=lambda br: abs(math.log(math.sqrt(br[0] * br[1]) / near)))
    for _ in range(60):
        mid = math.sqrt(a * b)
        a, b = (mid, b) if (diff(mid) < 0) == below else (a, mid)
    return math.sqrt(a * b), below


def flip_sentence(model: Model, win: Job, other: Job) -> str:
    """Where the cost model says ``other`` would beat ``win``: the link rate and the gradient size at which their
    predicted communication times cross; a sentence saying why not where it cannot say."""
    algs = (win.comm, other.comm)
    if not all(a in MODELLED_ALGORITHMS for a in algs) or win.layout.world_size == 1:
        return ""  # torch's own comms, 16-bit hops and auto: the model does not price them as one algorithm
    unfitted = [n for n in ("intra", "inter") if getattr(model, n).gbit_per_s is None]
    if unfitted:
        return f"No crossing point: the cost model's {' and '.join(unfitted)} bandwidth was not fitted."
    layout, size = win.layout, float(win.metrics["param_bytes"])

    def gap(m: Model, total: float) -> float:  # win minus other, predicted seconds per step
        return (_comm_per_step(m, win.comm, layout, total, win.bucket_mb)
                - _comm_per_step(m, other.comm, layout, total, other.bucket_mb))

    now_win, now_other = (_comm_per_step(model, a, layout, size, j.bucket_mb) for a, j in zip(algs, (win, other)))
    if now_win >= now_other:
        return (f"The cost model does not reproduce this order (it predicts {win.comm} {ms(now_win)} and "
                f"{other.comm} {ms(now_other)} of communication per step), so it gives no crossing point.")
    overtakes, never = [], []
    if layout.nnodes > 1:
        fitted = model.inter.gbit_per_s * 1e3

        def at_rate(mbit: float) -> float:
            return gap(replace(model, inter=Level(model.inter.alpha_s, 8 / (mbit * 1e6))), size)

        found = _crossing(at_rate, 1.0, 1e6, fitted)
        if found is None:
            never.append(f"link rate from 1 Mbit/s to 1 Tbit/s (the fitted inter-node level: {human_rate(fitted)})")
        else:
            overtakes.append(f"links {'faster' if found[1] else 'slower'} than {human_rate(found[0])} (the nearest "
                             f"crossing; the fitted inter-node level: {human_rate(fitted)})")
    found = _crossing(lambda total: gap(model, total), size / 100, size * 100, size)
    if found is None:
        never.append(f"gradient size from {human_bytes(size / 100)} to {human_bytes(size * 100)}")
    else:
        overtakes.append(f"gradients {'larger' if found[1] else 'smaller'} than {human_bytes(found[0])}")
    out = []
    if overtakes:
        out.append(f"By the cost model's predicted communication per step, {other.comm} would overtake {win.comm} "
                   f"with {'; or with '.join(overtakes)}.")
    if never:
        out.append(f"{'It' if overtakes else 'The cost model'} keeps {win.comm} ahead of {other.comm} at every "
                   f"{' and every '.join(never)}.")
    return " ".join(out)
