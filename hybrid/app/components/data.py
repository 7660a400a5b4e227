"""How each worker reads its mini-batches: a map-style dataset in one global order, through a DataLoader.

Any map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs will
do (a user's own, built from ``data._target_``, or one of the shipped ones in
:mod:`hybrid.app.components.datasets`). :class:`BatchStream` knows its position as
(epoch, samples consumed by all ranks), so a run resumes mid-epoch on exactly
the samples it would have read next, on the same layout or another one
(:class:`GlobalOrderSampler`).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

__all__ = ["ArrayDataset", "BatchStream", "GlobalOrderSampler"]


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


class GlobalOrderSampler(Sampler[int]):
    """This rank's share of one global order of the samples, consumed a global batch at a time.

    Every epoch draws one permutation of all samples from ``seed + epoch`` (as DistributedSampler does).
    Global batch k of the epoch is the block ``perm[k W B : (k + 1) W B]`` of W workers x B samples, and
    rank r reads its slice ``[r B, (r + 1) B)`` of it. So where an epoch stands is one number, the samples
    all ranks have consumed together, and it means the same on any world size: a run resumed on another
    layout reads exactly the epoch's remaining samples, none twice, none skipped (but for the tail that
    does not fill a whole global batch, dropped as ``drop_last`` does). With gradient accumulation a step
    reads several global batches, so the samples of a step do not depend on how its global batch is split
    into workers and micro-batches either.
    """

    def __init__(self, num_samples: int, world: int, rank: int, batch_size: int, seed: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        self.num_samples, self.world, self.rank, self.batch_size, self.seed = num_samples, world, rank, batch_size, seed
        self.epoch, self.start = 0, 0

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, samples: int) -> None:
        """Start the epoch after ``samples`` samples consumed by all ranks together."""
        self.start = samples

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        for block in range(len(self) // self.batch_size):
            first = self.start + block * self.global_batch + self.rank * self.batch_size
            yield from order[first:first + self.batch_size].tolist()

    def __len__(self) -> int:
        return (self.num_samples - self.start) // self.global_batch * self.batch_size


class BatchStream:
    """An endless stream of mini-batches that knows its position: (epoch, samples consumed in it by all ranks)."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world: int, seed: int,
                 pin_memory: bool, num_workers: int) -> None:
        self.sampler = GlobalOrderSampler(len(dataset), world, rank, batch_size, seed)
        if len(dataset) < self.sampler.global_batch:
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
        self.batch_size, self.num_samples = batch_size, len(dataset)
        self.epoch, self.samples = 0, 0
        self._iter: Iterator | None = None

    def state(self) -> dict[str, int]:
        """Where the stream stands, the same on every rank and meaningful on any world size."""
        return {"epoch": self.epoch, "samples": self.samples}

    def restore(self, state: dict[str, int], samples_per_batch: int | None = None) -> str | None:
        """Stand where ``state`` says; returns a note where that position can only be approximated.
        ``samples_per_batch``: for an older hybrid's per-rank position, the samples one of its batches took
        from the epoch on the layout that wrote it (workers x batch size; default: this stream's)."""
        note = None
        if "samples" in state:
            samples = int(state["samples"])
        else:  # an older hybrid's per-rank position (epoch, batch), in DistributedSampler's order
            samples = int(state["batch"]) * (samples_per_batch or self.sampler.global_batch)
            note = (f"data position {dict(state)} is from an older hybrid (per-rank batches in another sample "
                    f"order): continuing at global sample {samples} of epoch {state['epoch']}; the rest of this "
                    "epoch is not exactly the samples the old order had left, later epochs are whole")
        self.epoch, self.samples = int(state["epoch"]), samples
        self._iter = None
        return note

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.samples + self.sampler.global_batch > self.num_samples:
            self.epoch, self.samples, self._iter = self.epoch + 1, 0, None
        if self._iter is None:
            self.sampler.set_epoch(self.epoch)
            self.sampler.set_start(self.samples)
            self._iter = iter(self.loader)
        self.samples += self.sampler.global_batch
        return next(self._iter)
