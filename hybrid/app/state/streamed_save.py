"""Write a checkpoint whose largest tensors arrive one at a time, without holding them all.

A node-sharded optimizer's checkpoint holds the whole optimizer state in torch's
own form, but no worker holds it: it is gathered bucket by bucket to rank 0.
Gathering all of it before ``torch.save`` would give rank 0, once per
checkpoint, the memory DDP's workers have all the time. Instead:

1. ``torch.save`` writes the state under ``torch.serialization.skip_data``:
   every storage gets its place in the file (the gathered ones are placeholders
   from ``torch.empty``, never touched, so they cost address space, not memory),
   no bytes are written;
2. the file is opened with ``torch.load(mmap=True)`` to learn where each storage
   lies (its mapped address less the mapping's start, which the zip's own
   directory gives), without reading any of it;
3. every storage held in memory is written at its place, then each deferred one
   as it arrives (:class:`Deferred`), and dropped.

The file is an ordinary torch checkpoint: ``torch.load`` reads it like any other.
"""

from __future__ import annotations

import os
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import torch

__all__ = ["Deferred", "save_streamed"]

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip member's local header, before its name and extra field


class Deferred(Protocol):
    """Placeholders in a state, and what fills them; ``fill`` is collective where the data is gathered."""

    def placeholders(self) -> list[torch.Tensor]:
        """The state's tensors (``torch.empty``) whose bytes arrive later."""

    def fill(self, write: Callable[[torch.Tensor, torch.Tensor, int], None] | None) -> None:
        """Produce each placeholder's data and hand it to ``write(placeholder, data, first element)``, in parts of
        any size (None: this process only takes part in producing it). Called once, on every process that takes
        part."""


def save_streamed(path: Path, state: dict[str, Any], deferred: Deferred) -> None:
    """``torch.save(state, path)`` with ``deferred``'s placeholders written as their data arrives."""
    with torch.serialization.skip_data():
        torch.save(state, path)
    places = _storage_places(path, state)
    waiting = {t.untyped_storage().data_ptr() for t in deferred.placeholders()}
    fd = os.open(path, os.O_WRONLY)
    try:
        for ptr, (offset, storage) in places.items():
            if ptr not in waiting:
                _pwrite_all(fd, storage, offset)

        def write(placeholder: torch.Tensor, data: torch.Tensor, first: int = 0) -> None:
            storage = placeholder.untyped_storage()
            at = first * placeholder.element_size()
            if data.dtype != placeholder.dtype or at + data.nbytes > storage.nbytes():
                raise ValueError(f"{data.nbytes} bytes of {data.dtype} at element {first} of a placeholder of "
                                 f"{storage.nbytes()} bytes of {placeholder.dtype}")
            _pwrite_all(fd, data.untyped_storage(), places[storage.data_ptr()][0] + at, data)

        deferred.fill(write)
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, storage: torch.UntypedStorage, offset: int, tensor: torch.Tensor | None = None) -> None:
    """Write a storage's bytes (or a contiguous tensor's) at ``offset``, without copying them."""
    source = tensor if tensor is not None else torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    view = memoryview(source.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _storage_places(path: Path, state: Any) -> dict[int, tuple[int, torch.UntypedStorage]]:
    """Each storage of ``state`` (by its data pointer): where its bytes go in the file ``torch.save`` wrote."""
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    pairs = [(mine.untyped_storage(), theirs.untyped_storage()) for mine, theirs in _tensor_pairs(state, loaded)
             if mine.untyped_storage().nbytes()]
    if not pairs:
        return {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        starts = []
        for info in archive.infolist():
            if "/data/" in info.filename and not info.filename.endswith("/"):
                f.seek(info.header_offset)
                header = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
                starts.append(info.header_offset + _LOCAL_HEADER.size + header[-2] + header[-1])
    base = min(theirs.data_ptr() for _, theirs in pairs) - min(starts)
    places = {mine.data_ptr(): (theirs.data_ptr() - base, mine) for mine, theirs in pairs}
    if not {offset for offset, _ in places.values()} <= set(starts):
        raise RuntimeError(f"{path}: the storages of the saved state do not line up with the file's records")
    return places


def _tensor_pairs(mine: Any, theirs: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every tensor of ``mine`` with its counterpart in ``theirs`` (the same nesting of dicts, lists, tuples)."""
    if isinstance(mine, torch.Tensor):
        yield mine, theirs
    elif isinstance(mine, dict):
        for key, value in mine.items():
            yield from _tensor_pairs(value, theirs[key])
    elif isinstance(mine, (list, tuple)):
        for a, b in zip(mine, theirs):
            yield from _tensor_pairs(a, b)
