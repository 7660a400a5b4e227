"""hydra-submitit-launcher's launchers, with each sweep job's resources taken from that job's own config.

The plugin resolves ``hydra.launcher`` once, from the sweep's base config,
and submits every job of the sweep with those resources: in
``-m hydra/launcher=slurm cluster.nnodes=2,4`` both jobs would get the nodes of
``cluster.nnodes``' default. These subclasses resolve ``hydra.launcher`` per
job (``nodes: ${cluster.nnodes}`` is 2 for one job, 4 for the other), submit
each group of jobs with equal resources as one submitit array, and then wait
for all of them. What runs in each task is the plugin's own ``__call__``.

Hydra accepts launchers only from the ``hydra_plugins`` namespace: the
concrete ``PerJobSlurmLauncher`` / ``PerJobLocalLauncher`` are defined in
``hydra_plugins/hybrid_slurm_launcher`` (named by ``conf/hydra/launcher/slurm*.yaml``).

A job has one task per node (:mod:`hybrid.runtime.slurm`); the result handed back to
Hydra is that of the task whose worker held global rank 0 (it returns the
final loss, the others NaN), or of a failed task. On Slurm the launcher waits by
slurmctld's records (:mod:`hybrid.app.slurm_wait`: a cancelled job is reported, a
requeued one waited for), asks Slurm to keep an elastic job (``cluster.min_nnodes``)
running when a node fails (``--no-kill``), and, when Slurm warns of the time limit,
lets the workers checkpoint before submitit requeues the job (:meth:`PerJobResources.checkpoint`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from omegaconf import OmegaConf, open_dict

from hybrid.app.slurm_wait import wait_for_jobs
from hybrid.app.state.preemption import wait_for_stop
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

__all__ = ["PerJobResources", "rank0_return"]

log = logging.getLogger(__name__)

STOP_WAIT_S = 60.0  # within the warning's lead on the time limit (hydra.launcher.signal_delay_s, 120 s)


def rank0_return(returns: Sequence[JobReturn]) -> JobReturn:
    """The task result that speaks for the job: a failure first, else the one holding a loss."""
    for r in returns:
        if r.status == JobStatus.FAILED:
            return r
    for r in returns:
        if isinstance(r.return_value, float) and not math.isnan(r.return_value):
            return r
    return returns[0]


def _check_job(job_cfg: Any, params: dict[str, Any], overrides: Sequence[str]) -> Any:
    """The job's settings, validated, and its Slurm tasks one per node of ``cluster.nnodes``; if not, one
    line on stderr and exit 2 (as the single-run precheck does), before any job of the sweep is queued."""
    from hybrid.app.config import validate  # here: an error in it must not hide the launcher (hydra_plugins)

    app = job_cfg.copy()
    with open_dict(app):
        del app["hydra"]
    job = " ".join(filter_overrides(overrides)) or "(no overrides)"
    try:
        settings = validate(OmegaConf.to_object(app))  # type: ignore[arg-type]
        tasks = int(params.get("nodes") or 1) * int(params.get("tasks_per_node") or 1)
        if tasks != settings.cluster.nnodes:
            raise ValueError(f"hydra.launcher asks for {tasks} task(s) (nodes x tasks_per_node) but "
                             f"cluster.nnodes={settings.cluster.nnodes}: one task per node")
    except ValueError as exc:
        # SystemExit passes Hydra's error report (which would print a traceback for an exception).
        print(f"error: sweep job {job}: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return settings


def _job_dir(job_cfg: Any, idx: int) -> Path:
    """Where Hydra will run job ``idx`` of the sweep (``hydra.sweep.dir / hydra.sweep.subdir``, as its
    ``run_job`` resolves them), known before the job starts: a job Slurm ends before it starts still gets
    its record there."""
    with open_dict(job_cfg.hydra.job):
        job_cfg.hydra.job.num = idx
        job_cfg.hydra.job.id = f"job_id_for_{idx}"
    return Path(str(job_cfg.hydra.sweep.dir)) / str(job_cfg.hydra.sweep.subdir)


class PerJobResources(BaseSubmititLauncher):
    """The plugin's launcher, resources per sweep job; concrete in hydra_plugins.hybrid_slurm_launcher."""

    def _job_params(self, overrides: Sequence[str], idx: int) -> tuple[dict[str, Any], Path, bool]:
        """``hydra.launcher`` as resolved in this job's config (the sweep's base config would not see its
        overrides), after checking the job's settings: bad input fails here, in one line, before anything is
        queued, not in every task once Slurm has started it. Also the job's directory, and whether it is elastic."""
        assert self.config is not None and self.hydra_context is not None
        job_cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        params = OmegaConf.to_container(job_cfg.hydra.launcher, resolve=True)
        assert isinstance(params, dict)
        params.pop("_target_", None)
        settings = _check_job(job_cfg, params, overrides)
        if settings.cluster.min_nnodes and self._EXECUTOR == "slurm":
            # An elastic job outlives a lost node: Slurm must not end the job (sbatch) or its step (srun) when
            # one of its nodes fails; the survivors' agents go on without it.
            params["additional_parameters"] = {**(params.get("additional_parameters") or {}), "no-kill": True}
            params["srun_args"] = [*(params.get("srun_args") or []), "--no-kill"]
        return params, _job_dir(job_cfg, idx), bool(settings.cluster.min_nnodes)

    def _executor(self, params: dict[str, Any]) -> Any:
        """A submitit executor for ``params``, mapped exactly as the plugin maps ``hydra.launcher``."""
        import submitit

        params = dict(params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit in the task holding its global rank 0 when Slurm's warning signal arrives
        (before the time limit, or ``scancel --signal``): wait until the workers, who got the signal too,
        have stopped at one agreed step and checkpointed there (:mod:`hybrid.app.state.preemption`), then hand
        submitit the same job to requeue; the requeued job resumes from that checkpoint."""
        from hydra.core.hydra_config import HydraConfig

        asked = time.time() - 1.0
        try:
            run_dir: Path | None = Path(HydraConfig.get().runtime.output_dir)
        except ValueError:  # no job of ours runs in this process
            run_dir = None
        if run_dir is not None:
            step = wait_for_stop(run_dir, asked, STOP_WAIT_S)
            log.info(f"the workers stopped after step {step} with a checkpoint; requeueing" if step is not None else
                     f"the workers did not stop within {STOP_WAIT_S:.0f} s; requeueing (the last checkpoint counts)")
        return super().checkpoint(*args, **kwargs)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and len(job_overrides) > 0
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        groups: dict[str, tuple[dict[str, Any], list[int]]] = {}
        job_dirs: dict[int, Path] = {}
        elastic: set[int] = set()
        for i, overrides in enumerate(job_overrides):
            params, job_dirs[i], may_shrink = self._job_params(overrides, initial_job_idx + i)
            if may_shrink:
                elastic.add(i)
            groups.setdefault(json.dumps(params, sort_keys=True, default=str), (params, []))[1].append(i)
        jobs: dict[int, Any] = {}
        for params, indices in groups.values():
            job_params = []
            for i in indices:
                idx = initial_job_idx + i
                log.info(f"\t#{idx} : {' '.join(filter_overrides(job_overrides[i]))}")
                job_params.append((list(job_overrides[i]), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                                   Singleton.get_state()))
            jobs.update(zip(indices, self._executor(params).map_array(self, *zip(*job_params))))
        if self._EXECUTOR != "slurm":  # submitit's local executor: its own processes, its own wait
            return [rank0_return(jobs[i].results()) for i in range(len(job_overrides))]
        return wait_for_jobs(jobs, job_dirs, job_overrides, rank0_return, elastic)
