"""Waiting for a sweep's Slurm jobs: each one's result from submitit, its fate from slurmctld.

submitit's own wait (``job.results()``) ends when every task has written its result file, and learns
of jobs that never will only through ``sacct``; with accounting off it waits forever for a cancelled
job. Here slurmctld's record (:func:`hybrid.runtime.slurm_records.job_record`) decides when a job is
over: results are read once Slurm says the job has ended (a requeued job is PENDING again, and the
result files of its interrupted run do not count), and a job that ended without them (``scancel``,
a node failure, a time limit) becomes a failed job return that names its Slurm state, while the other
jobs of the sweep go on. Every job directory gets ``slurm.json``: the Slurm job id, final state,
nodes, exit code and how often Slurm requeued it (the report reads it).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import AbstractSet as Set
from typing import Any, Callable, Mapping, Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides

from hybrid.runtime.slurm_records import ACTIVE, OUTCOME_FILE, job_record

__all__ = ["SlurmJobEnded", "wait_for_jobs"]

log = logging.getLogger(__name__)

POLL_S = 2.0
RESULT_GRACE_S = 30.0  # after Slurm says a job ended, how long its result files may take to appear
PARTIAL_GRACE_S = 5.0  # an elastic job: after that long, the results of the tasks that wrote one
SILENT_S = 300.0  # slurmctld knows none of the unfinished jobs for this long: stop waiting


class SlurmJobEnded(RuntimeError):
    """A Slurm job ended without a result (cancelled, failed, timed out, its node lost)."""


def _tasks_with_results(job: Any) -> list[Any]:
    tasks = [job.task(t) for t in range(job.num_tasks)]
    for task in tasks:
        try:  # as submitit does: refreshes a network file system's cached view of the folder
            task.paths.folder.chmod(task.paths.folder.stat().st_mode)
        except OSError:
            pass
    return [task for task in tasks if task.paths.result_pickle.exists()]


def _read_results(job: Any, tasks: list[Any], speaker: Callable[[list[JobReturn]], JobReturn]) -> JobReturn | None:
    """What ``tasks`` (those that wrote a result) returned, as ``speaker`` sums it up (an elastic job that lost a
    node completes without that node's task's result); None if none can be read."""
    try:
        returns = [task.results()[0] for task in tasks]
    except Exception as exc:  # a result file that does not load, or a task's own error: the job has no result
        log.warning(f"Slurm job {job.job_id}: its result files do not load ({type(exc).__name__}: {exc})")
        return None
    return speaker(returns) if returns else None


def _outcome(job: Any, record: Mapping[str, str] | None, overrides: Sequence[str]) -> dict[str, Any]:
    record = record or {}
    return {"job_id": job.job_id, "state": record.get("JobState", "UNKNOWN"), "nodes": record.get("NodeList", ""),
            "exit_code": record.get("ExitCode", ""), "requeued": int(record.get("Restarts", "0") or 0),
            "reason": record.get("Reason", ""), "overrides": list(filter_overrides(overrides))}


def _ended(outcome: Mapping[str, Any], job_dir: Path) -> JobReturn:
    what = " ".join(outcome["overrides"]) or "(no overrides)"
    message = (f"sweep job {job_dir.name} ({what}): Slurm job {outcome['job_id']} ended {outcome['state']} "
               f"without a result (exit code {outcome['exit_code'] or '?'}, reason {outcome['reason'] or 'none'})")
    log.error(message)
    ret = JobReturn(overrides=list(outcome["overrides"]), working_dir=str(job_dir))
    ret.status = JobStatus.FAILED
    ret.return_value = SlurmJobEnded(message)
    return ret


def wait_for_jobs(jobs: Mapping[int, Any], job_dirs: Mapping[int, Path], overrides: Sequence[Sequence[str]],
                  speaker: Callable[[list[JobReturn]], JobReturn], elastic: Set[int] = frozenset()) -> list[JobReturn]:
    """Each submitit job's return (``speaker`` picks the one of its tasks' returns that speaks for it), in the
    order of ``jobs``' keys, once slurmctld says every job has ended. ``elastic``: the jobs that may finish
    without some of their tasks (a lost node's)."""
    returns: dict[int, JobReturn] = {}
    ended_at: dict[int, float] = {}
    heard = time.monotonic()
    while len(returns) < len(jobs):
        for i, job in jobs.items():
            if i in returns:
                continue
            record = job_record(job.job_id)
            now = time.monotonic()
            if record is not None:
                heard = now
                if record["JobState"] in ACTIVE:
                    ended_at.pop(i, None)
                    continue
            have = _tasks_with_results(job)  # one look at the folder per job and poll
            if record is None and len(have) < job.num_tasks:
                continue  # no record (not yet, a slow answer, or purged): SILENT_S bounds the wait
            ended_at.setdefault(i, now)
            outcome = _outcome(job, record, overrides[i])
            # A job that did not complete has no result to trust: a task killed by scancel or a lost node
            # may still have written one (its agent's exception, which need not even unpickle).
            completed = record is None or outcome["state"] == "COMPLETED"
            # Every task's result, or after the grace those there are (a lost node's task wrote none).
            whole = len(have) == job.num_tasks or (i in elastic and now - ended_at[i] >= PARTIAL_GRACE_S)
            read = _read_results(job, have, speaker) if completed and whole else None
            if read is not None:
                returns[i] = read
            elif not completed or now - ended_at[i] >= RESULT_GRACE_S:
                returns[i] = _ended(outcome, job_dirs[i])
            else:
                continue
            job_dirs[i].mkdir(parents=True, exist_ok=True)
            (job_dirs[i] / OUTCOME_FILE).write_text(json.dumps(outcome, indent=1) + "\n")
        if len(returns) < len(jobs):
            if time.monotonic() - heard > SILENT_S:
                raise SlurmJobEnded(f"slurmctld has known none of jobs "
                                    f"{', '.join(jobs[i].job_id for i in jobs if i not in returns)} for "
                                    f"{SILENT_S:.0f} s (scontrol show job): stopped waiting")
            time.sleep(POLL_S)
    return [returns[i] for i in sorted(returns)]
