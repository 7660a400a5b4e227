"""report.md's tables: per model size, every job's step and phase times against ``flat`` and the cost model;
each ``comm=auto`` job against the fastest fixed algorithm; every job beside plain DDP (torch's own).

Each table names its measure in its columns and says under it what a figure means, so the numbers can be read
without the code. The breakdown table lives in :mod:`hybrid.tools.report.breakdown`.
"""

from __future__ import annotations

import math
import statistics

from hybrid.app.observability.metrics import TAIL_STEPS
from hybrid.core.units import human_bytes
from hybrid.tools.report.format import fmt
from hybrid.tools.report.job import PHASE_COLUMNS, Job, is_reference

__all__ = ["FIXED", "auto_table", "model_tables", "peers_table"]

FIXED = ("flat", "hierarchical", "sharded")


def model_tables(jobs: list[Job]) -> list[str]:
    """Markdown, one table per model size: step time, rank 0's time in each phase's calls per step, samples/s,
    the speed-ups over ``flat`` on the same cluster shape, and the predicted communication time (``predicted_s``,
    set beforehand) with its error."""
    lines = []
    for model_name in sorted({j.model for j in jobs}):
        group = [j for j in jobs if j.model == model_name]
        sizes = {j.metrics["param_bytes"] for j in group if j.ok}
        size = f", {human_bytes(max(sizes))} of gradients" if sizes else ""
        lines += [f"## {model_name}{size}", "",
                  "| shape | comm | step ms | " + " | ".join(f"{p} ms (time in call)" for p in PHASE_COLUMNS)
                  + " | comm ms/step (time in calls) | samples/s | comm speed-up vs flat | step speed-up vs flat "
                  "| predicted comm ms | error |", "|" + " --- |" * 13]
        for job in [j for j in group if j.ok]:
            flat = next((f for f in group if f.ok and f.comm == "flat" and f.layout == job.layout), None)
            comm_up = flat.comm_per_step_s / job.comm_per_step_s if flat and job.comm_per_step_s > 0 else None
            step_up = flat.step_s / job.step_s if flat else None
            lines.append(
                f"| {job.layout} | {job.comm} | {fmt(job.step_s)} | "
                + " | ".join("-" if is_reference(job.comm) else fmt(job.phase_s(p)) for p in PHASE_COLUMNS)
                + f" | {'-' if is_reference(job.comm) else fmt(job.comm_per_step_s)} | "
                f"{fmt(job.metrics['samples_per_s'], 1, 0)} | {fmt(comm_up, 1, 2)} | {fmt(step_up, 1, 2)} | "
                f"{fmt(job.predicted_s)} | {fmt(job.extra.get('error'), 100, 0) + '%' if 'error' in job.extra else '-'} |")
        lines += ["", "Time in call: rank 0's seconds inside each phase's calls, per step (the run's total over its "
                      "steps), whether or not backward hid them; rank 0 leads node 0, so its intra_broadcast only "
                      "sends, while the other ranks' wait in theirs shows in the breakdown's exposed times. "
                      "torch's own comms (ddp, hsdp) have no phase counters: '-'.", ""]
    return lines


def auto_table(jobs: list[Job]) -> tuple[list[str], list[float]]:
    """Markdown rows: each finished auto job against the fastest fixed algorithm on its shape and model, by
    median step time (the first step excluded) and by communication time per step; and the step-time ratios."""
    lines = ["## comm=auto against the fastest fixed algorithm", "",
             "auto / best > 1 means auto was slower. Step: median step time (the first step excluded); "
             "comm: communication seconds per step (what auto's choice changes).", "",
             "| model | shape | auto choices (bucket bytes: algorithm) | auto step ms | best fixed | best step ms "
             "| auto / best | auto comm ms | best fixed by comm | best comm ms | auto / best comm |",
             "|" + " --- |" * 11]
    ratios = []
    for job in [j for j in jobs if j.ok and j.comm == "auto"]:
        fixed = [f for f in jobs if f.ok and f.comm in FIXED and f.layout == job.layout and f.model == job.model]
        if not fixed:
            continue
        best = min(fixed, key=lambda f: f.metrics["median_step_s"])
        ratio = job.metrics["median_step_s"] / best.metrics["median_step_s"]
        ratios.append(ratio)
        by_comm = min(fixed, key=lambda f: f.comm_per_step_s)
        comm_ratio = job.comm_per_step_s / by_comm.comm_per_step_s if by_comm.comm_per_step_s > 0 else None
        lines.append(f"| {job.model} | {job.layout} | {job.metrics.get('runs_as', '-')} | "
                     f"{fmt(job.metrics['median_step_s'])} | {best.comm} | {fmt(best.metrics['median_step_s'])} | "
                     f"{fmt(ratio, 1, 3)} | {fmt(job.comm_per_step_s)} | {by_comm.comm} | "
                     f"{fmt(by_comm.comm_per_step_s)} | {fmt(comm_ratio, 1, 3)} |")
    if ratios:
        lines += ["", f"auto / best step time: worst {max(ratios):.3f}, median {statistics.median(ratios):.3f} over "
                      f"{len(ratios)} shape(s) x model(s).", ""]
    return (lines if ratios else []), ratios


def peers_table(jobs: list[Job]) -> list[str]:
    """Every finished job side by side with plain DDP on its shape and model: the peers' comparison. The tail
    loss (every rank's loss over the last TAIL_STEPS steps) is shown only for runs longer than that window;
    over a shorter run it would be the mean of the whole run, not its end."""
    done = [j for j in jobs if j.ok]
    if not done:
        return []
    tail = any(j.steps > TAIL_STEPS and j.metrics.get("tail_loss") is not None for j in done)
    lines = ["## Side by side with torch's own (plain DDP, its hooks, HSDP)", "",
             "| model | shape | comm | samples/s | vs ddp | peak RSS MB (largest rank) | optimizer state MB (largest "
             "rank) | NIC MB/step (busiest node) | final loss |"
             + (f" loss, mean of the last {TAIL_STEPS} steps (all ranks) |" if tail else ""),
             "|" + " --- |" * (10 if tail else 9)]
    for job in done:
        ddp = next((d for d in done if d.comm == "ddp" and d.layout == job.layout and d.model == job.model), None)
        m = job.metrics
        vs = m["samples_per_s"] / ddp.metrics["samples_per_s"] if ddp else None
        nic, rss = m.get("nic_tx_bytes_per_step"), max(m.get("peak_rss_mb") or [math.nan])
        state = max(m.get("optimizer_state_bytes") or [math.nan])  # written since comm.shard_optimizer
        tail_loss = m.get("tail_loss") if job.steps > TAIL_STEPS else None
        lines.append(f"| {job.model} | {job.layout} | {job.comm} | {fmt(m['samples_per_s'], 1, 0)} | "
                     f"{fmt(vs, 1, 2)} | {fmt(rss, 1, 0)} | {fmt(state, 2**-20, 1)} | {fmt(nic, 1e-6, 2)} | "
                     f"{fmt(m.get('final_loss'), 1, 4)} |"
                     + (f" {fmt(tail_loss, 1, 4)} |" if tail else ""))
    if tail:
        lines += ["", f"Loss over the last {TAIL_STEPS} steps: '-' for runs of {TAIL_STEPS} steps or fewer, where "
                      "it would be the whole run's mean."]
    return lines + [""]
