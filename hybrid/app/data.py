"""How each worker reads its mini-batches: a map-style dataset through DistributedSampler and a DataLoader.

Any map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs will
do (a user's own, built from ``data._target_``, or one of the shipped ones in
:mod:`hybrid.app.datasets`). :class:`BatchStream` knows its (epoch, batch)
position, so a run resumes mid-epoch on exactly the samples it would have
read next.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["ArrayDataset", "BatchStream", "ResumableDistributedSampler"]


class ArrayDataset(Dataset):
    """Rows of two equally long arrays (numpy memmaps or tensors), returned as tensors."""

    def __init__(self, inputs: Any, targets: Any) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inputs[index], self.targets[index]
        x = torch.from_numpy(np.array(x)) if isinstance(x, np.ndarray) else x
        y = torch.as_tensor(np.array(y)) if not isinstance(y, torch.Tensor) else y
        if x.is_floating_point():
            x = x.float()
        return x, y.long()


class ResumableDistributedSampler(DistributedSampler):
    """DistributedSampler that can start part-way into an epoch (for exact resume)."""

    start = 0

    def set_start(self, index: int) -> None:
        self.start = index

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start


class BatchStream:
    """An endless stream of mini-batches that knows its (epoch, batch) position."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world: int, seed: int,
                 pin_memory: bool, num_workers: int) -> None:
        self.sampler = ResumableDistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        self.batches_per_epoch = self.sampler.num_samples // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"data has {len(dataset)} samples: too few for {world} worker(s) x "
                f"data.batch_size={batch_size}"
            )
        # A private generator: creating an iterator then draws its worker seed
        # from it, not from the global RNG, so resuming mid-run (which creates
        # one extra iterator) leaves the global RNG stream untouched.
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=True,
                                 pin_memory=pin_memory, num_workers=num_workers,
                                 generator=torch.Generator().manual_seed(seed + rank))
        self.batch_size = batch_size
        self.epoch, self.batch = 0, 0
        self._iter: Iterator | None = None

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._iter = None

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch >= self.batches_per_epoch:
            self.epoch, self.batch, self._iter = self.epoch + 1, 0, None
        if self._iter is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.set_start(self.batch * self.batch_size)
            self._iter = iter(self.loader)
        self.batch += 1
        return next(self._iter)
