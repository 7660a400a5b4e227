"""Rank code for tests/test_trainer.py: several training runs inside one launched job.

Each run goes through the trainer's real per-rank loop (train_worker), so
starting workers (seconds each on this machine) is paid once per layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hybrid.app.config import TrainConfig
from hybrid.app.observability.metrics import NullMetrics
from hybrid.app.worker import train_worker
from hybrid.core.topology import discover_topology
from hybrid.runtime.distributed import init_distributed, shutdown_distributed


def runs(root: str, plan: list[tuple[str, TrainConfig]]) -> dict[str, Any]:
    """``plan``: (run name, its settings); runs happen in order."""
    env = init_distributed(timeout_s=120)
    out: dict[str, Any] = {}
    try:
        topology = discover_topology(env)
        torch.set_num_threads(1)
        for name, cfg in plan:
            result = train_worker(cfg, topology, torch.device("cpu"), Path(root) / name, NullMetrics(), env.rank)
            if result is not None:
                out[name] = result
    finally:
        shutdown_distributed()
    return out
