"""A testbed link whose rate changes while a job runs (``cluster.testbed.link_schedule``).

A schedule is a list of changes, each at a step or at a number of seconds since the launch, with a rate for
every node or one per node. Only the process that built the testbed (the launcher) may reshape its links, so:

- a change at a step is applied between steps: rank 0 asks the launcher through a file in the run directory and
  waits for its answer, and every rank meets at a barrier after it, so that no byte of the next step crosses at
  the old rate (:class:`StepChanges`, in the workers; :class:`LinkScheduler`, in the launcher);
- a change in seconds is applied by the launcher on its own clock, wherever the job is.

A resumed or restarted job asks for the rate its first step is due (the launch rate before the first change), so
the links match the schedule at any step; the launcher reshapes only where the rate differs from the links' own.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["LinkChange", "LinkSchedule", "LinkScheduler", "StepChanges", "UNITS"]

UNITS = ("step", "s")
REQUESTS = ".link_schedule"  # the folder in the run directory where rank 0 asks and the launcher answers
POLL_S = 0.01


@dataclass(frozen=True)
class LinkChange:
    """From ``at`` on (steps done, or seconds since the launch), each node's NICs at ``mbit[node]`` Mbit/s."""

    at: float
    mbit: tuple[float, ...]


@dataclass(frozen=True)
class LinkSchedule:
    changes: tuple[LinkChange, ...]
    unit: str = "step"

    @classmethod
    def parse(cls, entries: Sequence[Any], unit: str, nnodes: int) -> "LinkSchedule":
        """``[[at, mbit], ...]`` with ``mbit`` a number (every node) or a list of ``nnodes`` numbers, ``at``
        strictly increasing and >= 0 (a whole number of steps with unit ``step``); one-line errors name the
        entry."""
        if unit not in UNITS:
            raise ValueError(f"cluster.testbed.link_schedule_unit={unit!r} is not one of {', '.join(UNITS)}")
        changes: list[LinkChange] = []
        for entry in entries:
            changes.append(_change(entry, unit, nnodes, changes[-1].at if changes else None))
        return cls(tuple(changes), unit)

    def due(self, at: float) -> LinkChange | None:
        """The change in force at ``at`` (the last one at or before it), or None before the first."""
        current = None
        for change in self.changes:
            if change.at <= at:
                current = change
        return current


def _change(entry: Any, unit: str, nnodes: int, previous: float | None) -> LinkChange:
    where = f"cluster.testbed.link_schedule entry {_show(entry)}"
    if not isinstance(entry, (list, tuple)) or len(entry) != 2:
        raise ValueError(f"{where} must be [{'step' if unit == 'step' else 'seconds'}, mbit]")
    at, mbit = entry
    whole = isinstance(at, int) or (isinstance(at, float) and at.is_integer())
    if isinstance(at, bool) or not isinstance(at, (int, float)) or at < 0 or (unit == "step" and not whole):
        raise ValueError(f"{where}: {at!r} must be {'a whole number of steps' if unit == 'step' else 'seconds'} >= 0")
    if previous is not None and at <= previous:
        raise ValueError(f"{where}: {at!r} must come after the entry before it ({previous:g})")
    rates = list(mbit) if isinstance(mbit, (list, tuple)) else [mbit] * nnodes
    if len(rates) != nnodes or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and r > 0
                                       for r in rates):
        raise ValueError(f"{where}: the rate must be one number > 0 (Mbit/s) or a list of {nnodes}, one per node")
    return LinkChange(float(at), tuple(float(r) for r in rates))


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, tuple, int, float, str)) else repr(value)


class StepChanges:
    """The workers' side of a schedule in steps: call :meth:`before` ahead of every step, on every rank."""

    def __init__(self, schedule: LinkSchedule, launched: Sequence[float], run_path: Path, rank: int,
                 barrier: Callable[[], None], timeout_s: float) -> None:
        self.schedule, self.folder, self.rank, self.barrier = schedule, run_path / REQUESTS, rank, barrier
        self.launched = LinkChange(0.0, tuple(float(r) for r in launched))  # cluster.testbed.link_mbit
        self.timeout_s = timeout_s
        self.current: tuple[float, ...] | None = None  # unknown until the first step: a restart may find any rate
        self.applied: list[dict[str, Any]] = []  # rank 0: metrics.json's link_changes

    def before(self, done: int) -> LinkChange | None:
        """With ``done`` steps done: the change that applies from the next step, once it is in place, or None.
        The first call always asks (the rate due there, the launch rate before the first change): an elastic
        restart under the same launcher may find the links at a rate a later step had set."""
        change = self.schedule.due(done) or self.launched
        if change.mbit == self.current:
            return None
        if self.rank == 0:
            self._ask(done, change)
            if change is not self.launched:
                self.applied.append({"after_step": done, "mbit": list(change.mbit)})
        self.barrier()  # every rank: nothing of the next step leaves before the links have their new rate
        self.current = change.mbit
        return change if change is not self.launched else None

    def _ask(self, done: int, change: LinkChange) -> None:
        self.folder.mkdir(exist_ok=True)
        want, answer = self.folder / f"want-{done}.json", self.folder / f"done-{done}"
        answer.unlink(missing_ok=True)  # a restart asks again at a step it asked at before
        temporary = want.with_suffix(".tmp")
        temporary.write_text(json.dumps({"mbit": list(change.mbit)}))
        os.replace(temporary, want)
        deadline = time.monotonic() + self.timeout_s
        while not answer.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the testbed's links were not reshaped to {list(change.mbit)} Mbit/s after step "
                                   f"{done} within {self.timeout_s:g} s: is the launcher that built the testbed alive?")
            time.sleep(POLL_S)
        error = answer.read_text()
        if error:
            raise RuntimeError(f"reshaping the testbed's links after step {done} failed: {error}")


class LinkScheduler:
    """The launcher's side: a thread that applies a schedule to the links it owns, through ``reshape`` (one rate
    per node), until :meth:`stop`. ``said`` gets one line per change."""

    def __init__(self, schedule: LinkSchedule, launched: Sequence[float], reshape: Callable[[Sequence[float]], None],
                 run_path: Path, said: Callable[[str], None]) -> None:
        self.schedule, self.reshape, self.folder, self.said = schedule, reshape, run_path / REQUESTS, said
        self.current = tuple(float(r) for r in launched)  # what the links have now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="link-schedule", daemon=True)

    def __enter__(self) -> "LinkScheduler":
        if self.folder.is_dir():  # an earlier launch's requests in the same run directory are not this one's
            shutil.rmtree(self.folder)
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        pending = list(self.schedule.changes)
        while not self._stop.wait(POLL_S):
            if self.schedule.unit == "s":
                elapsed = time.monotonic() - self._started
                while pending and pending[0].at <= elapsed:
                    change = pending.pop(0)
                    try:
                        self._apply(change.mbit, f"{change.at:g} s after the launch")
                    except Exception as exc:  # one line, and the schedule goes on: the next change may hold
                        self.said(f"testbed: reshaping the links {change.at:g} s after the launch failed: "
                                  f"{type(exc).__name__}: {exc}")
            else:
                self._answer()

    def _answer(self) -> None:
        if not self.folder.is_dir():
            return
        for want in sorted(self.folder.glob("want-*.json")):
            done = want.stem.removeprefix("want-")
            error, line = "", None
            try:
                line = self._reshape(json.loads(want.read_text())["mbit"], f"after step {done}")
            except Exception as exc:  # the asking rank raises it, naming the step
                error = f"{type(exc).__name__}: {exc}"
            want.unlink()
            answer = self.folder / f"done-{done}"
            answer.with_suffix(".tmp").write_text(error)
            os.replace(answer.with_suffix(".tmp"), answer)  # whole: the asking rank reads it as soon as it exists
            if line is not None:
                self.said(line)

    def _apply(self, mbit: Sequence[float], when: str) -> None:
        line = self._reshape(mbit, when)
        if line is not None:
            self.said(line)

    def _reshape(self, mbit: Sequence[float], when: str) -> str | None:
        """Reshape where the rates differ from the links' own; the line that says so, or None."""
        rates = tuple(float(r) for r in mbit)
        if rates == self.current:
            return None
        self.reshape(rates)
        self.current = rates
        shown = f"{rates[0]:g}" if len(set(rates)) == 1 else "[" + ", ".join(f"{r:g}" for r in rates) + "]"
        return f"testbed: links at {shown} Mbit/s {when} (cluster.testbed.link_schedule)"
