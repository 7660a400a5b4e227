"""Stopping at one agreed step when Slurm warns of the end: a checkpoint, then the requeue continues from it.

submitit asks Slurm for a signal before the job's time limit (``--signal=USR2@90``: ``signal_delay_s``) and
Slurm sends it to every process of the job's step, the workers included. Each worker that receives it
proposes a step to stop after, two steps past the one it finished (compare-and-set in the default group's
store: the first proposal wins). Every rank reads the key after each step: no rank can finish the step
after the next one without the signalled rank, so every rank sees the proposal before passing it, and all
stop after the same step. There rank 0 writes a checkpoint (collectively, as every checkpoint), writes
:data:`STOPPED` beside it, and every worker returns without the run's end (no metrics.json): the run is not
over. The task that holds submitit's global rank 0 waits in its signal handler for that file
(:func:`wait_for_stop`) before submitit requeues the job; the job starts again in the same run directory and
resumes from that checkpoint (:func:`hybrid.runtime.slurm.slurm_restart`).

Only in the workers of a Slurm task (``hydra/launcher=slurm``); one store read per step.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["STOPPED", "Preempted", "SignalStop", "wait_for_stop"]

STOPPED = "stopped.json"  # in the run dir: the step the workers stopped after, for the requeue
_KEY = "hybrid/stop_after"
_MARGIN = 2  # steps past the signalled rank's last: every rank reads the key before it gets there


class Preempted(Exception):
    """The workers stopped after ``step`` on Slurm's warning, with a checkpoint there."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step} for Slurm (a checkpoint there; the requeued job continues)")
        self.step = step


def _slurm_signal() -> int | None:
    """The signal submitit asked Slurm for (its SUBMITIT_PREEMPT_SIGNAL, USR2 by default), in a Slurm task."""
    if os.environ.get("SUBMITIT_EXECUTOR") != "slurm" or not os.environ.get("SLURM_JOB_ID"):
        return None
    return getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)


class SignalStop:
    """A worker's side of the agreement; :meth:`for_slurm` gives None where no such signal comes."""

    def __init__(self, store: Any, signum: int) -> None:
        self.store, self._signalled, self._proposed = store, threading.Event(), False
        signal.signal(signum, lambda *_: self._signalled.set())

    @classmethod
    def for_slurm(cls) -> SignalStop | None:
        import torch.distributed as dist

        signum = _slurm_signal()
        if signum is None or not dist.is_initialized() or threading.current_thread() is not threading.main_thread():
            return None
        return cls(dist.distributed_c10d._get_default_store(), signum)

    def stop_after(self, done: int) -> int | None:
        """The agreed step to stop after, once there is one; ``done``: the steps this rank has finished."""
        if self._signalled.is_set() and not self._proposed:
            self.store.compare_set(_KEY, "", str(done + _MARGIN))
            self._proposed = True
        return int(self.store.get(_KEY)) if self.store.check([_KEY]) else None


def mark_stopped(run_path: Path, step: int) -> None:
    """Rank 0, after the checkpoint of ``step``: the file the requeueing task waits for."""
    tmp = run_path / f".{STOPPED}.tmp"
    tmp.write_text(json.dumps({"step": step, "time": time.time()}))
    os.replace(tmp, run_path / STOPPED)


def wait_for_stop(run_path: Path, since: float, timeout_s: float) -> int | None:
    """In the signalled task: the step the workers stopped after (their :data:`STOPPED` written after
    ``since``), or None if they did not within ``timeout_s`` (the requeue then resumes from the last
    periodic checkpoint)."""
    path, deadline = run_path / STOPPED, time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            said = json.loads(path.read_text())
            if said["time"] >= since:
                return int(said["step"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    return None
