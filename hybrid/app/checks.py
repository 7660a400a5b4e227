"""Turn bad command-line input into one line, before Hydra starts writing anything.

Hydra reports composition and type errors over several lines with a stack
trace hint, and only after creating the run directory. :func:`precheck`
composes the same config with Hydra's compose API first and returns a single
line naming the bad key or value and what is allowed (or ``None`` if all is
well), so ``main`` can exit 2 with nothing written.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hybrid.app.components.losses import batch_loss
from hybrid.app.components.models import param_bytes
from hybrid.app.components.optim import check_optimizer
from hybrid.app.config import (
    DILOCO,
    TrainConfig,
    TrainSchema,
    check_pairing,
    outer_optimizer,
    packaged_conf_dir,
    resume_continues_this_run,
    resume_target,
    validate,
)
from hybrid.app.replicas.base import PlainState
from hybrid.app.setup import build_loss, build_model, check_state_kind, load_dataset, sample_batch
from hybrid.app.state.checkpoint import CHECKPOINT_NAME, checkpoint_steps, latest_manifest
from hybrid.app.targets import ComponentError, first_line
from hybrid.core.units import human_bytes
from hybrid.runtime.cpu_limit import CpuLimitError, cgroup_root
from hybrid.runtime.slurm import in_submitit_task
from hybrid.runtime.testbed import testbed_available

__all__ = ["check_components", "check_devices", "compose_train_config", "check_resume", "check_run_dir", "check_testbed",
           "check_torchrun_layout", "one_line_error", "precheck", "prepare", "settings_of", "split_config_dirs",
           "torchrun_restart", "under_torchrun"]

# The schema every config and override is checked against (conf/config.yaml lists it in its defaults).
ConfigStore.instance().store(name="train_schema", node=TrainSchema)


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
        want = getattr(cfg.cluster, key)
        # Elastic (--nnodes MIN:MAX): after a node is lost torchrun restarts the workers with fewer nodes.
        allowed = range(cfg.cluster.min_nnodes or want, want + 1) if key == "nnodes" else range(want, want + 1)
        if given and value is not None and int(value) not in allowed:
            raise ValueError(
                f"cluster.{key}={getattr(cfg.cluster, key)} conflicts with torchrun's {key} ({value}): "
                "drop the override or change the torchrun arguments"
            )


def check_testbed(cfg: TrainConfig) -> None:
    if cfg.cluster.rdzv_backend == "etcd" and not cfg.cluster.rdzv_endpoint and in_submitit_task():
        raise ValueError("cluster.rdzv_backend=etcd under hydra/launcher=slurm needs cluster.rdzv_endpoint=H1:P1,H2:P2,"
                         "... (the members of an etcd cluster you run): hybrid starts one only for a local or "
                         "testbed job")
    if not cfg.cluster.testbed.enabled:
        if cfg.cluster.testbed.cpu_quota is not None:
            raise ValueError(f"cluster.testbed.cpu_quota={cfg.cluster.testbed.cpu_quota} limits the testbed's nodes: "
                             "set cluster.testbed.enabled=true too (or cpu_quota=null)")
        return
    if under_torchrun():
        raise ValueError("cluster.testbed.enabled=true starts its own nodes: run it without torchrun")
    if in_submitit_task():
        raise ValueError("cluster.testbed.enabled=true starts its own nodes: run it without hydra/launcher=slurm")
    reason = testbed_available()
    if reason:
        raise ValueError(f"cluster.testbed.enabled=true but {reason}")
    if cfg.cluster.testbed.cpu_quota is not None:
        try:
            cgroup_root()
        except CpuLimitError as exc:
            raise ValueError(str(exc)) from None


def check_devices(cfg: TrainConfig) -> None:
    if cfg.trainer.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("trainer.device='cuda' but torch.cuda.is_available() is False: use auto or cpu")
    uses_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    if cfg.comm.torch_hook == "bf16" and not _uses_nccl(cfg):
        raise ValueError("comm.torch_hook=bf16: torch's bf16_compress_hook runs only with NCCL on CUDA (torch "
                         "refuses it on gloo); on this machine use comm.torch_hook=fp16")
    if uses_cuda and not under_torchrun() and cfg.cluster.nproc_per_node > torch.cuda.device_count():
        raise ValueError(
            f"cluster.nproc_per_node={cfg.cluster.nproc_per_node} but this node has "
            f"{torch.cuda.device_count()} GPU(s): one worker per GPU"
        )


def _holds_something(path: Path) -> bool:
    """A file, or a directory with anything in it (an empty one, e.g. ``checkpoints`` linked to a bigger
    volume before the first run, holds no earlier run)."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def torchrun_restart() -> int:
    """Which restart of torchrun's workers this is (0: the first start). A restart continues its own run:
    its run dir holds this run's checkpoints, which :func:`hybrid.app.setup.restore_training` resumes."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if under_torchrun() else 0


def check_run_dir(run_dir: Path, resume: Any) -> None:
    """Never write into an earlier run's directory, unless resuming that very run."""
    earlier = [name for name in ("metrics.json", "checkpoints", "tb") if _holds_something(run_dir / name)]
    if earlier and resume_target(resume, run_dir) != run_dir.resolve():
        raise ValueError(
            f"run dir {str(run_dir)!r} already holds a run ({', '.join(earlier)}): choose another "
            "hydra.run.dir, or trainer.resume=true to continue it"
        )


def prepare(cfg: TrainConfig) -> None:
    """Checks that need the components and devices; also generates synthetic data once, up front."""
    check_testbed(cfg)
    check_devices(cfg)
    check_components(cfg)


def check_components(cfg: TrainConfig) -> None:
    """Build the dataset, model, loss and optimizer once, on the CPU, and put two samples through model and
    loss: what would fail in every worker fails here, in one line, before anything starts."""
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, torch.device("cpu"))
    if not any(p.requires_grad for p in model.parameters()):
        raise ComponentError(f"model._target_={cfg.model.target} has no trainable parameters: nothing to train")
    check_powersgd_buckets(cfg, param_bytes(model))
    loss_fn = build_loss(cfg.loss)
    check_optimizer(cfg.optim.optimizer, shard=cfg.comm.shard_optimizer and cfg.comm.algorithm != "ddp")
    if cfg.comm.algorithm == DILOCO:
        check_optimizer(outer_optimizer(cfg.comm))
    dataset = load_dataset(cfg.data)  # last: a built-in one may generate its data into data.root
    x, y = sample_batch(dataset, 2, torch.device("cpu"))
    try:
        loss = batch_loss(model, x, y, loss_fn)
    except Exception as exc:
        raise ComponentError(f"model={cfg.model.label} with loss={cfg.loss.label} cannot train on "
                             f"data={cfg.data.dataset.label} (a batch of {_shape(x)} inputs, {_shape(y)} targets): "
                             f"{type(exc).__name__}: {first_line(exc)}") from exc
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        raise ComponentError(f"loss._target_={cfg.loss.target} gave {_shape(loss)}: the loss must be a "
                             "floating-point scalar tensor")
    if not loss.requires_grad:
        raise ComponentError(f"loss._target_={cfg.loss.target} gave a loss that does not depend on the model's "
                             "parameters (no gradient): nothing to train")


def check_powersgd_buckets(cfg: TrainConfig, gradient_bytes: int) -> None:
    """torch's powerSGD_hook issues its second all-reduce from the first one's completion callback. On gloo
    those callbacks run on gloo's threads, so with two or more buckets in flight the ranks issue the
    all-reduces in different orders and gloo aborts (2x2 with 6 buckets aborts at the first compressed
    step). Refused before start unless every gradient fits DDP's one bucket (hybrid passes
    bucket_cap_mb, so DDP's first bucket is capped at it too, not at torch's 1 MiB default); NCCL is fine."""
    if cfg.comm.torch_hook != "powersgd" or _uses_nccl(cfg):
        return
    one_bucket = int(cfg.comm.bucket_mb * 2**20)
    if gradient_bytes > one_bucket:
        raise ValueError(f"comm.torch_hook=powersgd on gloo: this model's {human_bytes(gradient_bytes)} of "
                         f"gradients make more than one DDP bucket (comm.bucket_mb={cfg.comm.bucket_mb:g}), and "
                         "torch's PowerSGD hook then aborts on gloo (its second all-reduce is issued from gloo's "
                         "callbacks, in a different order per rank): use NCCL on CUDA, or comm.torch_hook=fp16")


def _uses_nccl(cfg: TrainConfig) -> bool:
    uses_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    return uses_cuda and torch.distributed.is_nccl_available()


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_shape(v)}" for k, v in value.items()) + "}"
    return type(value).__name__


def check_resume(resume: object, run_dir: Path | None, model_config: dict | None = None,
                 algorithm: str | None = None, no_decay: bool | None = None) -> None:
    """The run to resume must exist, be a hybrid run, and hold the same model, written the way ``comm``
    (``algorithm``) reads state, with its optimizer's param groups made as ``optim.no_decay`` makes them here,
    before any worker starts."""
    if resume_continues_this_run(resume) and run_dir is None:
        raise ValueError(
            "trainer.resume=true continues the run in hydra.run.dir: also give "
            "hydra.run.dir=<the earlier run's directory> (or trainer.resume=<that directory>)"
        )
    target = resume_target(resume, run_dir or Path("."))
    if target is None:
        return
    if not target.is_dir():
        raise ValueError(f"trainer.resume={str(resume)!r}: {str(target)!r} does not exist or is not a directory")
    directory = target / "checkpoints"
    if not checkpoint_steps(directory) and not (directory / CHECKPOINT_NAME).is_file():
        raise ValueError(
            f"trainer.resume={str(resume)!r}: {str(target)!r} has no checkpoints/{CHECKPOINT_NAME} "
            "(not a finished or checkpointed hybrid run)"
        )
    manifest = latest_manifest(target) or {}
    if algorithm is not None:
        check_state_kind(manifest.get("state_dict_kind", PlainState.kind), algorithm, str(resume))
    saved = manifest.get("model_config")
    if model_config is not None and saved is not None and saved != model_config:
        diff = ", ".join(f"model.{k}={saved.get(k)!r} there, {v!r} here"
                         for k, v in model_config.items() if saved.get(k) != v)
        raise ValueError(f"trainer.resume={str(resume)!r} holds a different model: {diff}")
    saved_no_decay = bool(manifest.get("optim_no_decay", False))  # before the key: one group
    if no_decay is not None and manifest and saved_no_decay != no_decay:
        raise ValueError(f"trainer.resume={str(resume)!r} was trained with optim.no_decay={str(saved_no_decay).lower()}"
                         f" ({'two param groups' if saved_no_decay else 'one param group'}), and its optimizer state "
                         f"is kept per group: resume it with optim.no_decay={str(saved_no_decay).lower()}")


def _split(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    task, hydra_overrides = [], {}
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key.startswith(("hydra.", "hydra/")) or key == "hydra":
            hydra_overrides[key] = arg.split("=", 1)[1] if "=" in arg else ""
        else:
            task.append(arg)
    return task, hydra_overrides


def one_line_error(exc: BaseException, conf_dir: Path, user_dirs: list[Path] | tuple[Path, ...] = ()) -> str:
    text = str(exc)
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if missing:
        group, choice = missing.groups()
        options = sorted({p.stem for d in (conf_dir, *user_dirs) for p in (d / group).glob("*.yaml")})
        return f"{group}={choice!r} is not one of {', '.join(options)}"
    cause = exc.__cause__ or exc
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        msg = getattr(cause, "msg", str(cause)).strip().splitlines()[0]
        return f"{cause.full_key}: {msg}{_did_you_mean(cause)}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _did_you_mean(cause: OmegaConfBaseException) -> str:
    """``; did you mean trainer.max_steps?`` for a key its config nearly has: a typed group's config class
    (cluster, comm, trainer) or the keys a component group's node has (model, data, loss, optim)."""
    owner, key, msg = getattr(cause, "object_type", None), getattr(cause, "key", None), str(getattr(cause, "msg", ""))
    if not isinstance(key, str):
        return ""
    if owner is not None and dataclasses.is_dataclass(owner) and f"Key '{key}' not in" in msg:
        known = [f.name for f in dataclasses.fields(owner)]
    elif f"Key '{key}' is not in struct" in msg and isinstance(getattr(cause, "parent_node", None), DictConfig):
        known = [str(k) for k in cause.parent_node.keys() if not str(k).startswith("_")]
    else:
        return ""
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    parent = cause.full_key.rsplit(".", 1)[0] + "." if "." in cause.full_key else ""
    if close:
        return f"; did you mean {' or '.join(parent + c for c in close)}?"
    # A component's node is open to new arguments, through Hydra's append syntax.
    return f"; to pass a new argument, +{cause.full_key}=..." if "is not in struct" in msg else ""


def compose_train_config(overrides: list[str], conf_dir: Path | None = None,
                         user_dirs: list[Path] | tuple[Path, ...] = ()) -> TrainConfig:
    """The validated settings ``python -m hybrid.train [--config-dir D] *overrides`` would run with (nothing is
    started); ``user_dirs`` are the ``--config-dir`` directories, searched as Hydra searches them."""
    extra = [f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in user_dirs)}]"] if user_dirs else []
    with initialize_config_dir(config_dir=str(conf_dir or packaged_conf_dir()), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[*extra, *overrides])
    return settings_of(cfg)


def settings_of(cfg: DictConfig) -> TrainConfig:
    """The validated settings of a composed config."""
    model, data = cfg.get("model") or {}, cfg.get("data") or {}
    check_pairing(model.get("_target_"), data.get("_target_"), data.get("kind"))  # before interpolations resolve
    return validate(OmegaConf.to_object(cfg))  # type: ignore[arg-type]


CONFIG_DIR_FLAGS = ("--config-dir", "-cd")


def split_config_dirs(argv: list[str]) -> tuple[list[str], list[Path]]:
    """``argv`` without Hydra's ``--config-dir D`` / ``--config-dir=D`` / ``-cd D``, and those directories."""
    rest, dirs = [], []
    args = iter(argv)
    for arg in args:
        flag, eq, value = arg.partition("=")
        if flag in CONFIG_DIR_FLAGS:
            dirs.append(Path(value if eq else next(args, "")).expanduser())
        else:
            rest.append(arg)
    return rest, dirs


def precheck(argv: list[str], conf_dir: Path | None = None,
             before_prepare: Callable[[TrainConfig], None] | None = None) -> str | None:
    """Compose, type-check and validate the config of ``argv``; return an error line or None.

    ``before_prepare(settings)`` runs once the config is valid, before :func:`prepare`'s first torch op (the
    command line forks its agents' server there)."""
    conf_dir = conf_dir or packaged_conf_dir()
    argv, user_dirs = split_config_dirs(argv)
    if any(arg.startswith("-") for arg in argv):
        return None  # --help, --cfg, -m ...: Hydra's own modes
    for directory in user_dirs:
        if not directory.is_dir():
            return f"--config-dir {str(directory)!r} does not exist or is not a directory"
    task, hydra_overrides = _split(argv)
    try:
        settings = compose_train_config(task, conf_dir, user_dirs)
        if under_torchrun():
            check_torchrun_layout(settings, task)
        run_dir = hydra_overrides.get("hydra.run.dir")
        if under_torchrun() and settings.cluster.min_nnodes and not run_dir:
            raise ValueError("cluster.min_nnodes under torchrun needs hydra.run.dir=<a fixed directory>: after a "
                             "node is lost the restarted workers resume from that run's checkpoints")
        if run_dir and not torchrun_restart():
            check_run_dir(Path(run_dir), settings.trainer.resume)
        if before_prepare is not None:  # before check_resume too: it may load a checkpoint's tensors
            before_prepare(settings)
        check_resume(settings.trainer.resume, Path(run_dir) if run_dir else None, settings.model.node,
                     settings.comm.algorithm, settings.optim.no_decay)
        prepare(settings)
    except (HydraException, OmegaConfBaseException) as exc:
        return one_line_error(exc, conf_dir, user_dirs)
    except ValueError as exc:
        return str(exc).strip().splitlines()[0]
    return None
