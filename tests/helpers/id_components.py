"""A dataset that carries each sample's index and a model that records the indices it trains on.

For tests/test_elastic.py: which samples a run consumed, read back after the run, without touching the
trainer. ``IndexedVectors`` is hybrid's synthetic vectors with feature 0 replaced by the sample's index;
``RecordingMLP`` is hybrid's MLP on the other features that, in a distributed run, appends one line per
forward (the batch's indices) to ``record_dir/w<WORLD>-rank<R>.txt``.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from hybrid.app.components.datasets import synthetic
from hybrid.app.components.models import MLP


class IndexedVectors(Dataset):
    def __init__(self, **synthetic_args) -> None:
        self.base = synthetic(**synthetic_args)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.base[index]
        x = x.clone()
        x[0] = float(index)
        return x, y


class RecordingMLP(nn.Module):
    def __init__(self, in_features: int, width: int, depth: int, classes: int, record_dir: str) -> None:
        super().__init__()
        self.mlp = MLP(in_features - 1, width, depth, classes)
        self.record_dir = record_dir

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized():
            path = Path(self.record_dir) / f"w{dist.get_world_size()}-rank{dist.get_rank()}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(" ".join(str(int(i)) for i in x[:, 0].tolist()) + "\n")
        return self.mlp(x[:, 1:])
