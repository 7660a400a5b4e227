"""Where one process's time goes: every step accounted by named span, and spans kept for a window of steps.

A :class:`StepRecorder` is fed from two sides:

- the training loop's thread, one span per part of a step (``data``,
  ``forward``, ``backward``, ``comm_wait``, ``optimizer``; ``checkpoint``):
  :meth:`StepRecorder.span` and :meth:`StepRecorder.backward`, which splits
  backward at the moment the last gradient was accumulated (a
  post-accumulate-grad hook on every parameter): before it autograd computes,
  after it DDP waits for the buckets' averages, which is the communication
  that backward did not hide;
- the communicators' phases, from whatever thread runs them
  (:class:`~hybrid.core.comm.counters.PhaseCounters` passes each one on with
  its start, bytes and bucket).

Every step's durations are summed (cheap: one dict add per span), which is
what per-rank accounting reads at :meth:`StepRecorder.end_step`; the spans
themselves are kept only while :attr:`StepRecorder.recording` is on (the
timeline's window), so a long run does not grow. Spans are also
``torch.profiler.record_function`` ranges named ``hybrid::<name>`` while a
torch profiler runs (entering one costs ~16 us here even with no profiler,
so it is skipped when none is active).

:func:`chrome_trace` turns every rank's spans into one Chrome Trace Event
document (Perfetto, chrome://tracing): a process per node, a track per
rank's loop and one or more per rank's communication (spans that overlap,
like flat's buckets in flight, go to tracks of their own).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch.autograd.profiler import record_function

__all__ = ["COMPUTE", "SEGMENTS", "Span", "StepRecorder", "StepTimes", "bucket_scope", "chrome_trace",
           "current_bucket", "profiler_range", "profiling"]

# The loop's parts of a step, in order; COMPUTE are the ones a rank spends on its own work.
SEGMENTS = ("data", "forward", "backward", "comm_wait", "optimizer")
COMPUTE = ("data", "forward", "backward", "optimizer")

# The DDP bucket being averaged on this thread ({"bucket": index, "bucket_bytes": n}), for the phases' spans.
current_bucket: ContextVar[dict[str, int] | None] = ContextVar("hybrid_current_bucket", default=None)


@contextmanager
def bucket_scope(index: int, nbytes: int) -> Iterator[None]:
    """Inside: phases recorded on this thread belong to bucket ``index`` of ``nbytes``."""
    token = current_bucket.set({"bucket": index, "bucket_bytes": nbytes})
    try:
        yield
    finally:
        current_bucket.reset(token)


def profiling() -> bool:
    """Whether a torch profiler runs, in any thread (torch's own process-wide flag; the C++ check is per thread)."""
    return torch.autograd.profiler._is_profiler_enabled


@contextmanager
def profiler_range(name: str) -> Iterator[None]:
    """``record_function("hybrid::<name>")`` while a torch profiler runs; nothing otherwise. A range on a thread
    other than the one that started the profiler (the groups' communication thread) is recorded where the
    profiler was started with ``experimental_config=_ExperimentalConfig(profile_all_threads=True)``."""
    if profiling():
        with record_function(f"hybrid::{name}"):
            yield
    else:
        yield


@dataclass
class Span:
    """One named interval of this process (``time.perf_counter`` seconds)."""

    name: str
    start: float
    end: float
    lane: str  # "loop" (the training loop's thread) or "comm" (a communicator phase)
    step: int
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepTimes:
    """One step of one rank: seconds per loop segment, per phase, and per phase not hidden behind backward."""

    segments: dict[str, float]
    phases: dict[str, float]
    exposed: dict[str, float]

    @property
    def compute(self) -> float:
        return sum(self.segments[s] for s in COMPUTE)


class StepRecorder:
    """This process's spans and per-step sums (see the module's docstring). Thread-safe for phases."""

    def __init__(self, phases: Sequence[str]) -> None:
        self.phase_names = tuple(phases)
        self.recording = False  # keep spans (the timeline's window)
        self.spans: list[Span] = []
        self.step = 0  # the step being run (1-based), for the spans
        self._lock = threading.Lock()
        self._segments = dict.fromkeys(SEGMENTS, 0.0)
        self._intervals: list[tuple[str, float, float]] = []  # this step's phases
        self._compute_end = 0.0  # when the step's last backward had accumulated its last gradient
        self._grad_seen: float | None = None
        self._hooks: list[Any] = []

    # -------------------------------------------------------------- the loop's side

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Time the enclosed part of the step as ``name`` (a :data:`SEGMENTS` name is accounted)."""
        with profiler_range(name):
            start = time.perf_counter()
            try:
                yield
            finally:
                self._loop_span(name, start, time.perf_counter(), args)

    def watch_gradients(self, module: torch.nn.Module) -> None:
        """Note when each parameter's gradient is accumulated, so :meth:`backward` can tell compute from wait."""
        for p in module.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, _: torch.Tensor) -> None:
        self._grad_seen = time.perf_counter()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, accounted as ``backward`` up to the last accumulated gradient and ``comm_wait``
        after it (DDP waiting for its buckets' averages). Without :meth:`watch_gradients` all of it is backward."""
        self._grad_seen = None
        with profiler_range("backward"):
            start = time.perf_counter()
            loss.backward()
            end = time.perf_counter()
        split = min(max(self._grad_seen or end, start), end)
        self._compute_end = split
        self._loop_span("backward", start, split, {})
        if end > split:
            self._loop_span("comm_wait", split, end, {})

    def mark_compute_end(self) -> None:
        """This step's compute is done now (where gradients are averaged after backward, not during it)."""
        self._compute_end = time.perf_counter()

    def _loop_span(self, name: str, start: float, end: float, args: dict[str, Any]) -> None:
        if name in self._segments:
            self._segments[name] += end - start
        if self.recording:
            self.spans.append(Span(name, start, end, "loop", self.step, args))

    def end_step(self) -> StepTimes:
        """This step's sums (and start the next step's at zero)."""
        with self._lock:
            intervals, self._intervals = self._intervals, []
        phases = dict.fromkeys(self.phase_names, 0.0)
        for name, start, end in intervals:
            phases[name] += end - start
        exposed = _exposed(intervals, self._compute_end, self.phase_names)
        segments, self._segments = self._segments, dict.fromkeys(SEGMENTS, 0.0)
        return StepTimes(segments, phases, exposed)

    def take_spans(self) -> list[Span]:
        """The spans kept so far (and forget them)."""
        with self._lock:
            spans, self.spans = self.spans, []
        return spans

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # -------------------------------------------------------------- the communicators' side

    def phase(self, name: str, start: float, end: float, nbytes: int, bucket: dict[str, int] | None) -> None:
        """A communicator phase ran from ``start`` to ``end`` (any thread)."""
        with self._lock:
            self._intervals.append((name, start, end))
            if self.recording:
                self.spans.append(Span(name, start, end, "comm", self.step, {"bytes": nbytes, **(bucket or {})}))


def _exposed(intervals: list[tuple[str, float, float]], after: float, names: Sequence[str]) -> dict[str, float]:
    """Per phase, the wall time after ``after`` during which it ran, where phases in flight at once (flat's
    buckets, a pipeline's pieces) share each moment equally: the shares add up to at most the wall time.
    One sweep over the intervals' ends, clipped at ``after``."""
    events = sorted((t, delta, name) for name, s, e in intervals if e > after
                    for t, delta in ((max(s, after), 1), (e, -1)))
    exposed = dict.fromkeys(names, 0.0)
    active: dict[str, int] = {}
    previous = after
    for t, delta, name in events:
        running = sum(active.values())
        if running and t > previous:
            for phase, count in active.items():
                exposed[phase] += (t - previous) * count / running
        previous = t
        active[name] = active.get(name, 0) + delta
        if not active[name]:
            del active[name]
    return exposed


def _lanes(spans: list[Span]) -> list[int]:
    """A track index per span such that spans on one track do not overlap (greedy, in start order)."""
    ends: list[float] = []
    lane_of = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda k: spans[k].start):
        lane = next((k for k, end in enumerate(ends) if end <= spans[i].start), len(ends))
        if lane == len(ends):
            ends.append(0.0)
        ends[lane] = spans[i].end
        lane_of[i] = lane
    return lane_of


def chrome_trace(ranks: Sequence[dict[str, Any]], origin: float, meta: dict[str, Any]) -> dict[str, Any]:
    """One Chrome Trace Event document from every rank's spans.

    ``ranks``: per rank ``{"rank", "node", "offset_s", "spans": [Span]}``, where ``offset_s`` brings the
    rank's clock to rank 0's; ``origin``: rank 0's time that becomes 0 us. Timestamps are microseconds.
    """
    events: list[dict[str, Any]] = []
    named_nodes: set[int] = set()
    for entry in ranks:
        rank, node, shift = entry["rank"], entry["node"], entry["offset_s"] - origin
        if node not in named_nodes:
            named_nodes.add(node)
            events.append({"ph": "M", "name": "process_name", "pid": node, "args": {"name": f"node {node}"}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": node, "args": {"sort_index": node}})
        loop = [s for s in entry["spans"] if s.lane == "loop"]
        comm = [s for s in entry["spans"] if s.lane == "comm"]
        tracks = {0: f"rank {rank}"}
        placed = [(s, 0) for s in loop]
        for s, lane in zip(comm, _lanes(comm)):
            tracks[1 + lane] = f"rank {rank} comm" + (f" {lane + 1}" if lane else "")
            placed.append((s, 1 + lane))
        for track, label in tracks.items():
            tid = rank * 100 + track
            events.append({"ph": "M", "name": "thread_name", "pid": node, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": node, "tid": tid,
                           "args": {"sort_index": tid}})
        for s, track in placed:
            events.append({"ph": "X", "name": s.name, "cat": s.lane, "pid": node, "tid": rank * 100 + track,
                           "ts": round((s.start + shift) * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3),
                           "args": {"rank": rank, "step": s.step, **s.args}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}
