"""Tensors that are address space only: a checkpoint's placeholders, written around and never read.

A streamed checkpoint lays its file out with a placeholder for every tensor whose bytes arrive later
(:mod:`hybrid.app.state.streamed_save`). Allocated with ``torch.empty`` they cost no memory while untouched, but
freeing them does: glibc serves large blocks with their own ``mmap`` and, on freeing one, raises its threshold
for doing so to that block's size (up to 32 MB), so that from then on the step's temporaries below it come from
the heap, which keeps what it once held: a DiLoCo checkpoint of GPT-2 would leave rank 0 ~45 MB larger for the
rest of the run. A placeholder mapped here is anonymous memory of its own, outside the allocator: untouched, it
costs nothing, and freed, it changes nothing.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["untouched_tensor"]


def untouched_tensor(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``shape`` and ``dtype`` in an anonymous mapping of its own (zeros where read; memory only
    where written), unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)
