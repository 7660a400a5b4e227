"""Checkpoints that a crash cannot half-write, loadable without unpickling code.

``save`` writes ``<dir>/last.pt`` through a temporary file that is flushed to
disk and renamed into place, so ``last.pt`` is always either the previous
complete checkpoint or the new complete one. Everything saved is tensors,
numbers, strings, lists and dicts, so ``torch.load(weights_only=True)`` reads
it (and refuses anything else).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["CHECKPOINT_NAME", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_NAME = "last.pt"


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / CHECKPOINT_NAME
    tmp = directory / f".{CHECKPOINT_NAME}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    return final


def load_checkpoint(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / "checkpoints" / CHECKPOINT_NAME
    if not Path(run_dir).is_dir():
        raise ValueError(f"trainer.resume={str(run_dir)!r} is not a directory (give a run dir or true)")
    if not path.is_file():
        raise ValueError(f"trainer.resume={str(run_dir)!r} has no checkpoints/{CHECKPOINT_NAME}: not a hybrid run dir")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}): {exc}") from exc
