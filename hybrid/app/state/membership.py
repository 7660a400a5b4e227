"""Who trained when: the run's layout history, and what a resume on another layout changes.

In data parallelism every replica holds the whole model, so a checkpoint
resumes on any world size: the data position is kept in global samples
(:class:`hybrid.app.components.data.GlobalOrderSampler`), the per-worker batch stays, and
so the global batch changes with the world size. What follows from that is
decided here, once, and said in one line: the learning rate is kept or
scaled by new / old global batch (``trainer.elastic_lr``), error-feedback
residuals of the old layout are dropped (their own module says why),
``comm=auto`` calibrates afresh at start-up as always. The history
(``membership``: step, nnodes, world size, why) travels in the checkpoint
and ends in metrics.json and TensorBoard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RunLayout", "apply_lr_policy", "describe_change", "history_after_resume", "start_history"]


@dataclass(frozen=True)
class RunLayout:
    """The facts of a run's layout that a resume compares."""

    nnodes: int
    world_size: int
    global_batch: int  # workers x data.batch_size x trainer.grad_accum_steps

    def entry(self, step: int, why: str) -> dict[str, Any]:
        return {"step": step, "nnodes": self.nnodes, "world_size": self.world_size,
                "global_batch": self.global_batch, "why": why}


def start_history(now: RunLayout) -> list[dict[str, Any]]:
    return [now.entry(0, "start")]


def _saved_layout(state: dict[str, Any], now: RunLayout) -> RunLayout:
    """The checkpoint's layout; one written before global batches were recorded had this run's per-worker
    batch (the only kind of resume that was possible then)."""
    world = int(state.get("world_size", now.world_size))
    per_worker = now.global_batch // now.world_size
    return RunLayout(int(state.get("nnodes", 0)) or now.nnodes, world, int(state.get("global_batch", world * per_worker)))


def history_after_resume(state: dict[str, Any], now: RunLayout, step: int, why: str) -> tuple[list[dict[str, Any]], RunLayout]:
    """The checkpoint's history, with an entry for this run where its layout differs; and the saved layout."""
    saved = _saved_layout(state, now)
    history = list(state.get("membership") or [saved.entry(0, "start")])
    if (saved.nnodes, saved.world_size, saved.global_batch) != (now.nnodes, now.world_size, now.global_batch):
        history.append(now.entry(step, why))
    return history, saved


def apply_lr_policy(policy: str, saved: RunLayout, now: RunLayout, optimizer: Any, scheduler: Any) -> str:
    """Keep the learning rate or scale it (and the schedule's base) by new / old global batch; say which."""
    if saved.global_batch == now.global_batch:
        return "learning rate unchanged (same global batch)"
    factor = now.global_batch / saved.global_batch
    if policy == "keep":
        return "learning rate kept (trainer.elastic_lr=keep)"
    for group in optimizer.param_groups:
        group["lr"] *= factor
        if "initial_lr" in group:
            group["initial_lr"] *= factor
    scheduler.base_lrs = [base * factor for base in scheduler.base_lrs]
    return f"learning rate scaled by {factor:.4g} (trainer.elastic_lr=scale)"


def describe_change(saved: RunLayout, now: RunLayout, lr: str) -> str:
    """The one line a layout change logs."""
    return (f"layout changed since the checkpoint: nnodes {saved.nnodes} -> {now.nnodes}, world size "
            f"{saved.world_size} -> {now.world_size}, global batch {saved.global_batch} -> {now.global_batch}; "
            f"data continues at the same global sample; {lr}")
