"""``python -m hybrid.train``: the Hydra app that runs a whole data-parallel training job.

Not under torchrun, it launches ``cluster.nnodes x cluster.nproc_per_node``
workers itself (one torch elastic agent per simulated node); under torchrun
every rank runs this app and the layout comes from torchrun; under
``-m hydra/launcher=slurm`` each submitit task runs one node (hybrid.slurm). Before Hydra
starts, :func:`main` composes the config once to turn bad input into a
one-line error (exit 2) and refuses to reuse an earlier run's directory.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from hybrid.config import TrainConfig, resume_target, validate

__all__ = ["main", "train"]

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def check_torchrun_layout(cfg: TrainConfig, overrides: list[str]) -> None:
    """Under torchrun the layout is torchrun's; an explicit cluster.* override must agree."""
    actual = {"nnodes": os.environ.get("GROUP_WORLD_SIZE"), "nproc_per_node": os.environ.get("LOCAL_WORLD_SIZE")}
    if cfg.cluster.intra_mode == "thread":
        # One process per node; cluster.nproc_per_node counts the devices (replicas) it drives.
        if actual.pop("nproc_per_node") not in (None, "1"):
            raise ValueError(
                f"cluster.intra_mode=thread runs one process per node that drives its devices: start torchrun with "
                f"--nproc-per-node 1 (it has {os.environ['LOCAL_WORLD_SIZE']}) and give cluster.nproc_per_node"
            )
    for key, value in actual.items():
        given = any(o.split("=", 1)[0].lstrip("+~") == f"cluster.{key}" for o in overrides)
        if given and value is not None and int(value) != getattr(cfg.cluster, key):
            raise ValueError(
                f"cluster.{key}={getattr(cfg.cluster, key)} conflicts with torchrun's {key} ({value}): "
                "drop the override or change the torchrun arguments"
            )


def check_testbed(cfg: TrainConfig) -> None:
    if not cfg.cluster.testbed.enabled:
        return
    if under_torchrun():
        raise ValueError("cluster.testbed.enabled=true starts its own nodes: run it without torchrun")
    from hybrid.slurm import in_submitit_task

    if in_submitit_task():
        raise ValueError("cluster.testbed.enabled=true starts its own nodes: run it without hydra/launcher=slurm")
    from hybrid.testbed import testbed_available

    reason = testbed_available()
    if reason:
        raise ValueError(f"cluster.testbed.enabled=true but {reason}")


def check_devices(cfg: TrainConfig) -> None:
    import torch

    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but torch.cuda.is_available() is False: use auto or cpu")
    uses_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    if uses_cuda and not under_torchrun() and cfg.cluster.nproc_per_node > torch.cuda.device_count():
        raise ValueError(
            f"cluster.nproc_per_node={cfg.cluster.nproc_per_node} but this node has "
            f"{torch.cuda.device_count()} GPU(s): one worker per GPU"
        )


def _holds_something(path: Path) -> bool:
    """A file, or a directory with anything in it (an empty one, e.g. ``checkpoints`` linked to a bigger
    volume before the first run, holds no earlier run)."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def check_run_dir(run_dir: Path, resume: Any) -> None:
    """Never write into an earlier run's directory, unless resuming that very run."""
    earlier = [name for name in ("metrics.json", "checkpoints", "tb") if _holds_something(run_dir / name)]
    if earlier and resume_target(resume, run_dir) != run_dir.resolve():
        raise ValueError(
            f"run dir {str(run_dir)!r} already holds a run ({', '.join(earlier)}): choose another "
            "hydra.run.dir, or trainer.resume=true to continue it"
        )


def prepare(cfg: TrainConfig) -> None:
    """Checks that need the data and devices; also generates synthetic data once, up front."""
    from hybrid.trainer import load_dataset

    check_testbed(cfg)
    check_devices(cfg)
    load_dataset(cfg)


def launch_job(settings: TrainConfig, entrypoint: Any, args: tuple) -> list[Any]:
    """Launch the layout locally: on loopback, or one network namespace per node (testbed).

    One process per device, or one per node with ``cluster.intra_mode=thread`` (``process_layout``)."""
    from hybrid.launch import launch_local

    tb = settings.cluster.testbed
    restarts = settings.cluster.max_restarts
    if not tb.enabled:
        return launch_local(settings.process_layout, entrypoint, args, timeout_s=settings.cluster.launch_timeout_s,
                            max_restarts=restarts)
    from hybrid.testbed import LinkShape, Testbed

    with Testbed(settings.cluster.nnodes, LinkShape(tb.link_mbit, tb.burst_kb, tb.latency_ms)) as bed:
        return launch_local(settings.process_layout, entrypoint, args, timeout_s=settings.cluster.launch_timeout_s,
                            nodes=bed.nodes, max_restarts=restarts)


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run the job described by ``cfg``; returns rank 0's metrics."""
    settings: TrainConfig = validate(OmegaConf.to_object(cfg))  # type: ignore[arg-type]
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
    from hybrid.slurm import SlurmNode, in_submitit_task
    from hybrid.trainer import run_worker

    if under_torchrun():
        check_torchrun_layout(settings, list(hydra_cfg.overrides.task))
        if os.environ.get("RANK") == "0":
            check_run_dir(run_dir, settings.trainer.resume)
        result = run_worker(settings, str(run_dir) if os.environ.get("RANK") == "0" else None)
    elif in_submitit_task():
        # One task per node (hydra/launcher=slurm): this task is the node's elastic agent. Every task of
        # the job has the same Hydra output dir, and every node checks it (no worker starts before the
        # last node has joined), so a refusal stops all nodes at once instead of leaving them to wait.
        node = SlurmNode.of_this_task(settings.cluster.nnodes, settings.cluster.rdzv_port)
        check_run_dir(run_dir, settings.trainer.resume)
        prepare(settings)
        # Processes per node as in launch_job: one per device, or one with cluster.intra_mode=thread.
        result = node.run(settings.process_layout.node_sizes[0], run_worker, (settings, str(run_dir)),
                          timeout_s=settings.cluster.launch_timeout_s,
                          max_restarts=settings.cluster.max_restarts).get(0)
    else:
        check_run_dir(run_dir, settings.trainer.resume)
        prepare(settings)
        result = launch_job(settings, run_worker, (settings, str(run_dir)))[0]
    if result is not None:
        print(f"TensorBoard logs: {run_dir / 'tb'}  (tensorboard --logdir {run_dir / 'tb'})")
        print(f"metrics: {run_dir / 'metrics.json'}")
    return result or {}


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> float:
    """The value a sweeper would minimise: the final training loss."""
    return float(train(cfg).get("final_loss", float("nan")))


def main() -> None:
    """Console entry: one-line errors for bad input, then Hydra."""
    from hybrid.cli_check import precheck

    argv = sys.argv[1:]
    if under_torchrun() and os.environ.get("RANK", "0") != "0":
        # Only rank 0 writes Hydra's files; the others get its run dir at start-up.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                     "hydra/hydra_logging=disabled", "hydra.run.dir=."]
    else:
        error = precheck(argv)
        if error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
    hydra_main()


if __name__ == "__main__":
    main()
