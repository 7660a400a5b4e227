"""Metrics on rank 0 only: TensorBoard scalars, HParams and a periodic status line.

Other ranks get :class:`NullMetrics`, so the training loop calls the same
methods everywhere and only rank 0 touches the run directory.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["Metrics", "NullMetrics", "TensorBoardMetrics", "write_json_atomic"]


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write to a temporary file, flush to disk, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def status(self, line: str) -> None:
        print(line, file=sys.stdout, flush=True)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def hparams(self, hparams: dict[str, Any], final: dict[str, float]) -> None:
        # run_name="." keeps the HParams entry in this run's own directory
        # instead of a timestamped sub-run.
        self.writer.add_hparams(hparams, {f"hparam/{k}": v for k, v in final.items()}, run_name=".")

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
