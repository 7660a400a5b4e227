"""``trainer.timeline=true``: one ``timeline.json`` per run, every rank's spans of a window of steps.

At start-up every rank measures its clock's offset to rank 0's
(:func:`hybrid.core.clock.align_to_rank0`, a few ping-pongs each); the
recorder keeps spans only for steps ``first..last`` of
``trainer.timeline_steps``. After step ``last`` (or at the end of a run that
stops before it) every rank hands its spans to rank 0 in one gather, and rank
0 writes the Chrome trace (:func:`hybrid.core.timeline.chrome_trace`)
atomically. ``otherData`` holds, per rank, the clock offset and its error
bound, and the seconds the phase counters summed over the window's steps,
against which the spans can be checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from hybrid.app.observability.metrics import Metrics, write_json_atomic
from hybrid.core.clock import ClockOffset, align_to_rank0
from hybrid.core.comm import PhaseStats
from hybrid.core.timeline import StepRecorder, chrome_trace
from hybrid.core.topology import Topology

__all__ = ["TimelineFile"]


class TimelineFile:
    """Drives the recorder's window and writes the file (collective at start-up and at the window's end)."""

    def __init__(self, recorder: StepRecorder, window: tuple[int, int], topology: Topology, run_path: Path,
                 metrics: Metrics, meta: dict[str, Any]) -> None:
        self.recorder, (self.first, self.last) = recorder, window
        self.rank, self.node = topology.rank, topology.node
        self.path, self.metrics, self.meta = run_path / "timeline.json", metrics, meta
        self.clock: ClockOffset = align_to_rank0()
        self.counted: dict[str, float] = {}
        self.done = False
        self.ran = False  # a step of the window ran in this invocation (a resumed run may start past it)

    def step_begin(self, step: int) -> None:
        self.recorder.step = step
        self.recorder.recording = self.first <= step <= self.last and not self.done
        self.ran = self.ran or self.recorder.recording

    def step_end(self, step: int, phases: dict[str, PhaseStats]) -> None:
        """After step ``step`` (its counters' interval in ``phases``); writes the file after the window's last."""
        if not self.first <= step <= self.last or self.done:
            return
        for name, stats in phases.items():
            self.counted[name] = self.counted.get(name, 0.0) + stats.seconds
        if step == self.last:
            self.write(step)

    def finish(self, last_step: int) -> None:
        """At the end of the run: write what the window holds if the run stopped inside it."""
        if not self.done and self.ran:
            self.write(last_step)

    def write(self, step: int) -> None:
        """Collective over the default group: rank 0 gathers every rank's spans and writes timeline.json."""
        self.done, self.recorder.recording = True, False
        mine = {"rank": self.rank, "node": self.node, "offset_s": self.clock.offset_s,
                "clock_error_s": self.clock.error_s, "spans": self.recorder.take_spans(), "counters_s": self.counted}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            return
        ranks = sorted(gathered, key=lambda g: g["rank"])
        meta = {**self.meta, "steps": [self.first, min(self.last, step)],
                "clock": {str(g["rank"]): {"offset_us": g["offset_s"] * 1e6, "error_bound_us": g["clock_error_s"] * 1e6}
                          for g in ranks},
                "counters_s": {str(g["rank"]): g["counters_s"] for g in ranks}}
        origin = min((s.start + g["offset_s"] for g in ranks for s in g["spans"]), default=0.0)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, chrome_trace(ranks, origin, meta))
        worst = max(g["clock_error_s"] for g in ranks) * 1e6
        self.metrics.status(f"timeline of steps {self.first}-{min(self.last, step)}: {self.path} (open in "
                            f"https://ui.perfetto.dev or chrome://tracing; clocks aligned to rank 0's within "
                            f"{worst:.0f} us)")
