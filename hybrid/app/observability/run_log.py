"""The run's log: what a run prints, also kept in ``train.log`` in its run directory; and its first line.

Hydra's job logging opens ``<run dir>/train.log`` for the ``logging`` module
of the process that runs Hydra, but the run's lines come from rank 0's worker
(another process, which prints them: status, step lines, warnings) and from
the launching process (the summary). Both go through :func:`say`, which
prints the line and appends it, time-stamped, to ``train.log``. The file is
opened for appending, as Hydra's handler opens it, so the writers add to it
and never truncate it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence, TextIO

from hybrid.core.units import human_bytes

__all__ = ["LOG_NAME", "RunLog", "describe_run", "say", "shown_path"]

LOG_NAME = "train.log"


class RunLog:
    """Prints lines and appends them to ``<run dir>/train.log`` (or only prints, without a run dir)."""

    def __init__(self, run_dir: Path | None) -> None:
        self._file: TextIO | None = None
        if run_dir is not None:
            Path(run_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(run_dir) / LOG_NAME, "a", buffering=1)  # line-buffered: a crash loses nothing

    def say(self, line: str) -> None:
        print(line, flush=True)
        if self._file is not None:
            self._file.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {line}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def say(run_dir: Path | None, *lines: str) -> None:
    """Print ``lines`` and append them to the run's log (one open and close: for the launcher's few lines)."""
    log = RunLog(run_dir)
    try:
        for line in lines:
            log.say(line)
    finally:
        log.close()


def shown_path(path: Path) -> str:
    """``path`` as a user would type it here: relative to the working directory where it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def describe_run(node_sizes: Sequence[int], comm: str, model: str, model_args: dict[str, Any],
                 gradient_bytes: int, run_dir: Path, thread_mode: bool = False) -> str:
    """The run's first line: layout, comm, model (with the ``width`` and ``depth`` of its ``model_args`` where it
    has them), gradient bytes and where its logs go, e.g. ``hybrid: 2 nodes x 2 workers, comm=hierarchical,
    model mlp (w256 d4), 846 KiB of gradients; logs and TensorBoard in outputs/runs/...``."""
    nnodes = len(node_sizes)
    nodes = f"{nnodes} node{'s' if nnodes != 1 else ''}"
    if len(set(node_sizes)) == 1:
        layout = f"{nodes} x {node_sizes[0]} worker{'s' if node_sizes[0] != 1 else ''}"
    else:
        layout = f"{nodes} ({'+'.join(map(str, node_sizes))} workers)"
    if thread_mode:
        layout += " (a process per node)"
    shape = " ".join(f"{k[0]}{model_args[k]}" for k in ("width", "depth")
                     if isinstance(model_args.get(k), int) and not isinstance(model_args.get(k), bool))
    return (f"hybrid: {layout}, comm={comm}, model {model}{f' ({shape})' if shape else ''}, "
            f"{human_bytes(gradient_bytes)} of gradients; logs and TensorBoard in {shown_path(run_dir)}")
