"""``python -m hybrid.train``: the Hydra app that runs a whole data-parallel training job.

Not under torchrun, it launches ``cluster.nnodes x cluster.nproc_per_node``
workers itself (one torch elastic agent per simulated node); under torchrun
every rank runs this app and the layout comes from torchrun; under
``-m hydra/launcher=slurm`` each submitit task runs one node (hybrid.runtime.slurm). Before Hydra
starts, :func:`main` composes the config once to turn bad input into a
one-line error (exit 2) and refuses to reuse an earlier run's directory.

Run directories are named by comm and layout (a single run) or by the job's
overrides (a sweep): :mod:`hybrid.app.observability.run_names`, whose
resolvers importing this module registers. The run's lines (rank 0's, and the
summary printed here) are also kept in its ``train.log``
(:mod:`hybrid.app.observability.run_log`).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from hybrid.app.checks import check_run_dir, check_torchrun_layout, precheck, prepare, settings_of, torchrun_restart, under_torchrun
from hybrid.app.config import CONF_PACKAGE, ClusterConfig, TrainConfig
from hybrid.app.observability.run_log import say
from hybrid.app.observability.run_names import register_resolvers
from hybrid.app.state.checkpoint import latest_manifest
from hybrid.app.worker import run_worker
from hybrid.runtime.agent import StoreLost
from hybrid.runtime.launch import launch_local, start_agent_server
from hybrid.runtime.link_schedule import LinkSchedule, LinkScheduler
from hybrid.runtime.slurm import SlurmNode, in_submitit_task, slurm_restart
from hybrid.runtime.testbed import LinkShape, Testbed, testbed_forks_agents

__all__ = ["EXIT_STORE_LOST", "launch_job", "main", "train"]

register_resolvers()  # before Hydra resolves hydra.run.dir / hydra.sweep.subdir, which name runs with them


def launch_job(settings: TrainConfig, entrypoint: Any, args: tuple, run_dir: Path | None = None) -> list[Any]:
    """Launch the layout locally: on loopback, or one network namespace per node (testbed).

    One process per device, or one per node with ``cluster.intra_mode=thread`` (``process_layout``). With a
    testbed link schedule, this process reshapes the links it built while the job runs, as the schedule says
    (its requests and its lines go through ``run_dir``)."""
    c = settings.cluster
    tb = c.testbed
    if not tb.enabled:
        return launch_local(settings.process_layout, entrypoint, args, timeout_s=c.launch_timeout_s,
                            rdzv_endpoint=c.rdzv_endpoint or None, **_elastic(c))
    links = [LinkShape(rate, tb.burst_kb, tb.latency_ms) for rate in tb.rates(c.nnodes)]
    schedule = tb.schedule(c.nnodes)
    with Testbed(c.nnodes, links, tb.nics_per_node, tb.cpus(c.nnodes)) as bed, \
            _scheduled(schedule, bed, run_dir):
        return launch_local(settings.process_layout, entrypoint, args, timeout_s=c.launch_timeout_s,
                            nodes=bed.nodes, store_network=bed.service, **_elastic(c))


def _scheduled(schedule: LinkSchedule | None, bed: Testbed, run_dir: Path | None) -> AbstractContextManager[Any]:
    """The launcher's side of ``cluster.testbed.link_schedule``, or nothing."""
    if schedule is None:
        return nullcontext()
    if run_dir is None:
        raise ValueError("cluster.testbed.link_schedule needs the run's directory (the trainer's)")
    return LinkScheduler(schedule, [link.rate_mbit for link in bed.links], bed.reshape, run_dir,
                         lambda line: say(run_dir, line))


def _elastic(c: ClusterConfig) -> dict[str, Any]:
    """What every node's elastic agent is told about restarts and membership, local or under Slurm."""
    return {"max_restarts": c.restarts, "min_nnodes": c.min_nnodes or None, "last_call_s": c.rdzv_last_call_s,
            "recovery": c.recovery, "rdzv_backend": c.rdzv_backend}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the job described by ``cfg``; returns rank 0's metrics."""
    settings = settings_of(cfg)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    result = _run(settings, hydra_cfg, run_dir)
    if result is not None:
        tb = run_dir / "tb"
        say(run_dir, f"TensorBoard logs: {tb}  (tensorboard --logdir {tb})", f"metrics: {run_dir / 'metrics.json'}")
    return result or {}


def _run(settings: TrainConfig, hydra_cfg: Any, run_dir: Path) -> dict[str, Any] | None:
    """This process's part of the job: a torchrun rank, a Slurm task's node, or the whole local launch;
    rank 0's result (None elsewhere)."""
    if under_torchrun():
        check_torchrun_layout(settings, list(hydra_cfg.overrides.task))
        if os.environ.get("RANK") == "0" and not torchrun_restart():
            check_run_dir(run_dir, settings.trainer.resume)
        result = run_worker(settings, str(run_dir) if os.environ.get("RANK") == "0" else None)
    elif in_submitit_task():
        # One task per node (hydra/launcher=slurm): this task is the node's elastic agent. Every task of
        # the job has the same Hydra output dir, and every node checks it (no worker starts before the
        # last node has joined), so a refusal stops all nodes at once instead of leaving them to wait.
        node = SlurmNode.of_this_task(settings.cluster.nnodes, settings.cluster.rdzv_port,
                                      settings.cluster.rdzv_endpoint)
        if not slurm_restart():  # a requeued job continues its own run (hybrid.app.setup.restore_training)
            check_run_dir(run_dir, settings.trainer.resume)
        elif (run_dir / "metrics.json").is_file():
            # Requeued after its run had finished (Slurm's warning came too late to stop it): the run stands.
            say(run_dir, f"Slurm requeue {slurm_restart()}: the run in {run_dir} had finished; nothing to do")
            return json.loads((run_dir / "metrics.json").read_text()) if node.rank == 0 else None
        prepare(settings)
        # Processes per node as in launch_job: one per device, or one with cluster.intra_mode=thread.
        result = node.run(settings.process_layout.node_sizes[0], run_worker, (settings, str(run_dir)),
                          timeout_s=settings.cluster.launch_timeout_s, **_elastic(settings.cluster)).get(0)
    else:
        check_run_dir(run_dir, settings.trainer.resume)
        _start_agent_server(settings)
        prepare(settings)
        result = launch_job(settings, run_worker, (settings, str(run_dir)), run_dir)[0]
    return result


def _start_agent_server(settings: TrainConfig) -> None:
    """Start the fork server of a local launch's agents, as a fork of this process: before this process's first
    torch op (the checks'), with torch imported, so that it imports only what the agents add (a later job of
    a sweep, or this run's own launch after the precheck, reuses it). A testbed without root starts its
    agents as commands inside its namespaces instead."""
    if not under_torchrun() and (not settings.cluster.testbed.enabled or testbed_forks_agents()):
        start_agent_server(run_worker, fork_this_process=True)


# The exit status of a job whose rendezvous store went (sysexits' EX_TEMPFAIL: try again later, here with
# trainer.resume=true): distinct from a failure of the training itself (1) and from bad input (2).
EXIT_STORE_LOST = 75


@hydra.main(version_base="1.3", config_path=f"pkg://{CONF_PACKAGE}", config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    """The value a sweeper would minimise: the final training loss."""
    try:
        return float(train(cfg).get("final_loss", float("nan")))
    except StoreLost as exc:
        run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
        manifest = latest_manifest(run_dir)
        kept = (f"its last checkpoint (step {manifest['step']}) is in {run_dir / 'checkpoints'}"
                if manifest else f"it saved no checkpoint in {run_dir}")
        say(run_dir, f"error: {exc}; {kept}: continue it with the same command and trainer.resume=true "
                     f"hydra.run.dir={run_dir}")
        sys.exit(EXIT_STORE_LOST)


def main() -> None:
    """Console entry: one-line errors for bad input, then Hydra."""
    argv = sys.argv[1:]
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        # Only rank 0 writes Hydra's files; the others get its run dir at start-up.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled", "hydra.run.dir=."]
    else:
        error = precheck(argv, before_prepare=_start_agent_server)
        if error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
    hydra_main()
