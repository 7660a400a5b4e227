"""What Slurm knows of a job: slurmctld's record (``scontrol show job``), for whoever waits on a job.

submitit learns a job's state from ``sacct`` alone. Where accounting is off (no slurmdbd: small clusters,
and the Slurm testbed) ``sacct`` fails, and submitit waits for a result file that a cancelled or failed
job never writes: forever. slurmctld itself keeps every job's record, finished ones included, for
``MinJobAge`` seconds (300 by default), with its state, nodes, exit code and how often it was requeued;
this module reads it. One ``scontrol`` call per job and poll.
"""

from __future__ import annotations

import subprocess

__all__ = ["ACTIVE", "OUTCOME_FILE", "job_record"]

# What a sweep job's directory holds of its Slurm job once it ended (hybrid.app.slurm_wait writes it).
OUTCOME_FILE = "slurm.json"

# States in which a job may still produce its result (a requeued job passes through PENDING again).
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                    "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "STOPPED", "RESV_DEL_HOLD"})


def _records(job_id: str, timeout_s: float) -> list[dict[str, str]]:
    try:
        done = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    records = []
    for line in done.stdout.splitlines():
        record: dict[str, str] = {}
        for field in line.split():
            key, sep, value = field.partition("=")
            if sep and key not in record:
                record[key] = value
        if "JobState" in record:
            records.append(record)
    return records


def job_record(job_id: str, timeout_s: float = 30.0) -> dict[str, str] | None:
    """slurmctld's record of ``job_id`` (``JobState``, ``NodeList``, ``Restarts``, ``ExitCode``, ``Reason``...),
    or None where slurmctld does not know the job (never, or no longer) or does not answer.

    An array element (``ARRAY_INDEX``) that has not started has no record of its own: it is one of the
    indices of its array's meta record (``ArrayTaskId=2-3``), whose state is its state (PENDING, or
    CANCELLED when cancelled before it started)."""
    found = _records(job_id, timeout_s)
    if found:
        return found[0]
    array, sep, index = job_id.partition("_")
    if not sep:
        return None
    records = _records(array, timeout_s)
    for record in records:
        if record.get("ArrayTaskId") == index:
            return record
    # The meta record: its task ids are a range or list ("2-3%1", "1,3"), or none left (4294967294).
    meta = [r for r in records if not r.get("ArrayTaskId", "").isdigit() or int(r["ArrayTaskId"]) >= 2**31]
    return meta[0] if meta else None
