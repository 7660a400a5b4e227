"""Turn bad command-line input into one line, before Hydra starts writing anything.

Hydra reports composition and type errors over several lines with a stack
trace hint, and only after creating the run directory. :func:`precheck`
composes the same config with Hydra's compose API first and returns a single
line naming the bad key or value and what is allowed (or ``None`` if all is
well), so ``main`` can exit 2 with nothing written.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = ["check_resume", "one_line_error", "precheck"]


def check_resume(resume: object, run_dir: Path | None, model_config: dict | None = None) -> None:
    """The run to resume must exist, be a hybrid run, and hold the same model, before any worker starts."""
    from hybrid.checkpoint import CHECKPOINT_NAME, checkpoint_steps, latest_manifest
    from hybrid.config import resume_continues_this_run, resume_target

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
    saved = (latest_manifest(target) or {}).get("model_config")
    if model_config is not None and saved is not None and saved != model_config:
        diff = ", ".join(f"model.{k}={saved.get(k)!r} there, {v!r} here"
                         for k, v in model_config.items() if saved.get(k) != v)
        raise ValueError(f"trainer.resume={str(resume)!r} holds a different model: {diff}")


def _split(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    task, hydra_overrides = [], {}
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key.startswith(("hydra.", "hydra/")) or key == "hydra":
            hydra_overrides[key] = arg.split("=", 1)[1] if "=" in arg else ""
        else:
            task.append(arg)
    return task, hydra_overrides


def one_line_error(exc: BaseException, conf_dir: Path) -> str:
    text = str(exc)
    missing = re.search(r"Could not find '([\w/]+)/([^']+)'", text)
    if missing:
        group, choice = missing.groups()
        options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
        return f"{group}={choice!r} is not one of {', '.join(options)}"
    cause = exc.__cause__ or exc
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        msg = getattr(cause, "msg", str(cause)).strip().splitlines()[0]
        return f"{cause.full_key}: {msg}"
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def precheck(argv: list[str], conf_dir: Path | None = None) -> str | None:
    """Compose, type-check and validate the config of ``argv``; return an error line or None."""
    from hybrid.config import validate
    from hybrid.train import CONF_DIR, check_run_dir, check_torchrun_layout, prepare, under_torchrun

    conf_dir = conf_dir or CONF_DIR
    if any(arg.startswith("-") for arg in argv):
        return None  # --help, --cfg, -m ...: Hydra's own modes
    task, hydra_overrides = _split(argv)
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            cfg = compose(config_name="config", overrides=task)
        settings = validate(OmegaConf.to_object(cfg))  # type: ignore[arg-type]
        if under_torchrun():
            check_torchrun_layout(settings, task)
        run_dir = hydra_overrides.get("hydra.run.dir")
        if run_dir:
            check_run_dir(Path(run_dir), settings.trainer.resume)
        check_resume(settings.trainer.resume, Path(run_dir) if run_dir else None, asdict(settings.model))
        prepare(settings)
    except (HydraException, OmegaConfBaseException) as exc:
        return one_line_error(exc, conf_dir)
    except ValueError as exc:
        return str(exc).strip().splitlines()[0]
    return None
