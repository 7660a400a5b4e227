"""Checkpoints that a crash, a full disk or a flipped bit cannot cost more than one interval.

Each save writes ``step-NNNNNNNN.pt`` through a temporary file that is
flushed and fsync'ed, then renamed into place, then a small manifest
``step-NNNNNNNN.json`` (step, size, sha256 of the file, and what the trainer
puts in: model config, world size) the same way; ``last.pt`` / ``last.json``
are hard links to the newest pair, swapped in by rename (for people and
tools; loading goes by the step files). The newest ``keep``
checkpoints are kept, older ones removed only after the new one is complete.

So at any moment every ``.pt`` file is either complete or absent; if a save
fails (disk full, I/O error) the temporary file is removed, the previous
checkpoints are untouched, and :class:`CheckpointError` says so. On load,
each candidate (newest step first) is checked against its
manifest (size: truncation; sha256: any other corruption) and loaded with
``torch.load(weights_only=True)``, which refuses to unpickle anything but
tensors and plain containers; the newest good one is used and every skipped
one is reported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from hybrid.app.state.streamed_save import Deferred, save_streamed

__all__ = [
    "CHECKPOINT_NAME",
    "CheckpointError",
    "checkpoint_steps",
    "latest_manifest",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

CHECKPOINT_NAME = "last.pt"
_STEP_FILE = re.compile(r"step-(\d{8})\.pt")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous ones are intact."""


class _HashingFile:
    """A binary file that hashes what passes through it (no second read of the checkpoint)."""

    def __init__(self, f: Any) -> None:
        self._f, self.sha256, self.size = f, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_replace(src: Path, dst: Path) -> None:
    """Make ``dst`` another name of ``src``, atomically replacing any old ``dst``."""
    tmp = dst.with_name(f".{dst.name}.link-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.link(src, tmp)
    os.replace(tmp, dst)


def _os_error(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc`` (itself, or what it was raised from / during)."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def checkpoint_steps(directory: Path) -> list[int]:
    """Steps with a checkpoint file in ``directory``, newest first."""
    if not Path(directory).is_dir():
        return []
    steps = [int(m.group(1)) for p in Path(directory).iterdir() if (m := _STEP_FILE.fullmatch(p.name))]
    return sorted(steps, reverse=True)


def save_checkpoint(directory: Path, state: dict[str, Any], step: int, keep: int = 3,
                    meta: dict[str, Any] | None = None, deferred: Deferred | None = None) -> Path:
    """Write ``state`` as the checkpoint of ``step``; keep the newest ``keep``. Returns its path. ``deferred``:
    placeholders in ``state`` whose data arrive one at a time (:mod:`hybrid.app.state.streamed_save`); its
    ``fill`` is called once, whatever happens, so that the processes producing the data are not left waiting."""
    if keep < 1:
        if deferred is not None:
            deferred.fill(None)
        raise ValueError(f"keep={keep} must be >= 1")
    pending = [deferred] if deferred is not None else []

    def filled_once(write: Any) -> None:
        if pending:
            pending.pop().fill(write)
    directory = Path(directory)
    final = directory / f"step-{step:08d}.pt"
    manifest = final.with_suffix(".json")
    tmp = directory / f".{final.name}.tmp-{os.getpid()}"
    tmp_manifest = directory / f".{manifest.name}.tmp-{os.getpid()}"
    previous = checkpoint_steps(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if deferred is None:
            with open(tmp, "wb") as f:
                hashing = _HashingFile(f)
                torch.save(state, hashing)
                f.flush()
                os.fsync(f.fileno())
            size, digest = hashing.size, hashing.sha256.hexdigest()
        else:
            save_streamed(tmp, state, _Once(deferred, filled_once))
            size, digest = _digest(tmp)
        record = {"step": step, "bytes": size, "sha256": digest, **(meta or {})}
        with open(tmp_manifest, "w") as f:
            json.dump(record, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        os.replace(tmp_manifest, manifest)
        _link_replace(final, directory / CHECKPOINT_NAME)
        _link_replace(manifest, directory / "last.json")
        _fsync_dir(directory)
    except (OSError, RuntimeError) as exc:  # torch's zip writer turns a failed write into RuntimeError
        cause = _os_error(exc)
        if cause is None and not isinstance(exc, OSError):
            raise
        kept = f"step-{previous[0]:08d}.pt" if previous else "none"
        raise CheckpointError(
            f"saving the checkpoint of step {step} in {str(directory)!r} failed: "
            f"{(cause.strerror if cause else None) or exc}; the previous checkpoint ({kept}) is intact"
        ) from exc
    finally:
        filled_once(None)  # a failure before the data were asked for: the producers still take their part
        tmp.unlink(missing_ok=True)
        tmp_manifest.unlink(missing_ok=True)
    for old in checkpoint_steps(directory)[keep:]:
        for suffix in (".pt", ".json"):
            (directory / f"step-{old:08d}{suffix}").unlink(missing_ok=True)
    return final


class _Once:
    """``deferred`` whose ``fill`` goes through ``filled_once`` (called at most once in all)."""

    def __init__(self, deferred: Deferred, filled_once: Callable[[Any], None]) -> None:
        self.deferred, self.filled_once = deferred, filled_once

    def placeholders(self) -> list[torch.Tensor]:
        return self.deferred.placeholders()

    def fill(self, write: Any) -> None:
        self.filled_once(write)


def _digest(path: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def verify_checkpoint(path: Path) -> str | None:
    """Why ``path`` cannot be trusted (missing, truncated, corrupt), or None if it matches its manifest."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    manifest = path.with_suffix(".json")
    if not manifest.is_file():
        return None  # written before manifests existed: torch.load's own checks still apply
    try:
        record = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return f"its manifest {manifest.name} is unreadable ({exc})"
    size = path.stat().st_size
    if size != record.get("bytes"):
        return f"truncated or extended: {size} bytes, {record.get('bytes')} written"
    if _digest(path)[1] != record.get("sha256"):
        return "corrupt: sha256 differs from the one recorded when it was written"
    return None


def latest_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The manifest of the newest checkpoint of ``run_dir`` (no checkpoint is loaded)."""
    directory = Path(run_dir) / "checkpoints"
    for step in checkpoint_steps(directory):
        try:
            return json.loads((directory / f"step-{step:08d}.json").read_text())
        except (OSError, ValueError):
            continue
    return None


def load_checkpoint(run_dir: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The newest good checkpoint of ``run_dir``; corrupt or truncated ones are reported and skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"trainer.resume={str(run_dir)!r} is not a directory (give a run dir or true)")
    directory = run_dir / "checkpoints"
    # Newest step first; last.pt is another name of the newest (or, from older versions, the only one).
    candidates = [directory / f"step-{s:08d}.pt" for s in checkpoint_steps(directory)]
    if not candidates and (directory / CHECKPOINT_NAME).is_file():
        candidates = [directory / CHECKPOINT_NAME]
    if not candidates:
        raise ValueError(f"trainer.resume={str(run_dir)!r} has no checkpoints/{CHECKPOINT_NAME}: not a hybrid run dir")
    problems = []
    for path in candidates:
        reason = verify_checkpoint(path)
        if reason is None:
            try:
                return torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # truncated zip, foreign pickle, ...
                reason = f"cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        problems.append(f"{path.name}: {reason}")
        log(f"checkpoint {str(path)!r} is unusable ({reason}): trying an older one")
    raise ValueError(f"no usable checkpoint in {str(directory)!r}: " + "; ".join(problems))
