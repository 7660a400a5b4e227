"""report.md's headlines: one sentence group per shape (model, cluster layout, network) saying which comm was
fastest and by how much, why (from what the jobs measured), and where the cost model puts the crossing.

The answer comes first in the report; the tables below it are the evidence.
"""

from __future__ import annotations

import math

from hybrid.core.costmodel import Model
from hybrid.core.topology import Layout
from hybrid.core.units import human_bytes, human_rate
from hybrid.tools.report.breakdown import exposed_s
from hybrid.tools.report.crossing import flip_sentence
from hybrid.tools.report.format import ms
from hybrid.tools.report.job import Job, is_reference

__all__ = ["headlines", "reason_sentence"]


def reason_sentence(win: Job, other: Job) -> str:
    """Why ``win`` beat ``other``, from what both jobs measured: NIC bytes (testbed), else time in phase calls,
    else exposed communication (per-rank accounts); empty where neither has it."""
    nic = [j.metrics.get("nic_tx_bytes_per_step") for j in (other, win)]
    if all(b is not None for b in nic):
        wires = [j.wire_s() for j in (other, win)]
        rates = {r for j in (other, win) for r in j.link_mbit or []}
        at = human_rate(rates.pop()) if len(rates) == 1 else "the nodes' link rates"
        wire = (f" (at least {ms(wires[0])} and {ms(wires[1])} on the wire at {at})"
                if all(w is not None for w in wires) else "")
        return (f"The busiest node's NIC sends {human_bytes(nic[0])} per step under {other.comm}, "
                f"{human_bytes(nic[1])} under {win.comm}{wire}.")
    if not is_reference(win.comm) and not is_reference(other.comm):
        return (f"Communication per step (rank 0's time in phase calls): {other.comm} "
                f"{ms(other.comm_per_step_s)}, {win.comm} {ms(win.comm_per_step_s)}.")
    exposed = [exposed_s(j.metrics) for j in (other, win)]
    if all(e is not None for e in exposed):
        return (f"Communication the step waited for (exposed, mean over ranks): {other.comm} {ms(exposed[0])}, "
                f"{win.comm} {ms(exposed[1])}.")
    return ""


def headlines(jobs: list[Job], model: Model | None) -> list[str]:
    """One markdown bullet per shape (model, cluster layout, network): who won, by how much, why, and where
    the cost model says the answer would flip."""
    groups: dict[tuple[str, Layout, str], list[Job]] = {}
    for job in jobs:
        if job.ok and math.isfinite(job.step_s):
            groups.setdefault((job.model, job.layout, job.network), []).append(job)
    lines = []
    for (model_name, layout, network), group in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1].world_size, kv[0][1].nnodes, kv[0][2])):
        ranked = sorted(group, key=lambda j: j.step_s)
        size = human_bytes(max(j.metrics["param_bytes"] for j in group))
        label = f"**{layout}, {model_name} ({size}), {network}:**"
        if len(ranked) == 1:
            lines.append(f"- {label} only {ranked[0].comm} finished on this shape: nothing to compare.")
            continue
        win, runner = ranked[0], ranked[1]
        flat = next((j for j in ranked if j.comm == "flat"), None)
        ratio = runner.step_s / win.step_s
        text = (f"{win.comm} is fastest, {ratio:.2f}x faster per step than {runner.comm} (runner-up; "
                f"{ms(win.step_s)} against {ms(runner.step_s)})" if f"{ratio:.2f}" != "1.00" else
                f"{win.comm} and {runner.comm} tie for fastest ({ms(win.step_s)} and {ms(runner.step_s)} per step)")
        if flat is not None and flat not in (win, runner):
            text += f" and {flat.step_s / win.step_s:.2f}x faster than flat ({ms(flat.step_s)})"
        other = flat if flat is not None and flat is not win else runner
        sentences = [text + ".", reason_sentence(win, other), flip_sentence(model, win, other) if model else ""]
        lines.append(f"- {label} " + " ".join(s for s in sentences if s))
    return lines
