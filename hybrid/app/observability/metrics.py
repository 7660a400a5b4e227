"""Metrics on rank 0 only: TensorBoard scalars, HParams and a periodic status line (printed and kept in the
run's ``train.log``, :mod:`hybrid.app.observability.run_log`).

Other ranks get :class:`NullMetrics`, so the training loop calls the same
methods everywhere and only rank 0 touches the run directory.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from hybrid.app.observability.run_log import RunLog

__all__ = ["TAIL_STEPS", "Metrics", "NullMetrics", "TensorBoardMetrics", "hparam_value", "write_json_atomic"]

# metrics.json's tail_loss: every rank's loss over this many last steps (run_metrics keeps them; the report reads them).
TAIL_STEPS = 20

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file, flush to disk, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def hparam_value(value: Any) -> int | float | str:
    """An HParams value of the type TensorBoard should show: numbers (and strings that spell one, as configs
    and command lines give them: ``'2'`` -> 2, ``'0.1'`` -> 0.1) as numbers, everything else as a string
    (``None`` -> ``'none'``, a list -> its text), so a key has one type in every run of a sweep. (TensorBoard
    skips a None, and shows a key whose type differs between runs as a string.)"""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        if _INT.fullmatch(text):
            return int(text)
        if _FLOAT.fullmatch(text):
            return float(text)
        return value
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(hparam_value(v)) for v in value) + "]"
    return str(value)


class Metrics:
    """The interface the trainer logs through."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def status(self, line: str) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...

    def hparams(self, hparams: dict[str, Any], final: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class NullMetrics(Metrics):
    """What every rank but 0 gets: logs nothing, writes nothing."""


class TensorBoardMetrics(Metrics):
    """Rank 0's: TensorBoard under ``log_dir``; status lines printed and, with ``run_dir``, kept in its
    ``train.log``."""

    def __init__(self, log_dir: Path, run_dir: Path | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        self.log = RunLog(run_dir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def status(self, line: str) -> None:
        self.log.say(line)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def hparams(self, hparams: dict[str, Any], final: dict[str, float]) -> None:
        # run_name="." keeps the HParams entry in this run's own directory
        # instead of a timestamped sub-run.
        self.writer.add_hparams({k: hparam_value(v) for k, v in hparams.items()},
                                {f"hparam/{k}": v for k, v in final.items()}, run_name=".")

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
        self.log.close()
