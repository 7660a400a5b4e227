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


def job_record(job_id: str, timeout_s: float = 30.0) -> dict[str, str] | None:
    """slurmctld's record of ``job_id`` (``JobState``, ``NodeList``, ``Restarts``, ``ExitCode``, ``Reason``...),
    or None where slurmctld does not know the job (never, or no longer) or does not answer."""
    try:
        done = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0 or not done.stdout.strip():
        return None
    record: dict[str, str] = {}
    for field in done.stdout.splitlines()[0].split():
        key, sep, value = field.partition("=")
        if sep and key not in record:
            record[key] = value
    return record if "JobState" in record else None
