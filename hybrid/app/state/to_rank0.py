"""Objects of state (tensors in dicts) from every rank to rank 0 and back, each message as long as what its rank
holds.

Rank to rank as torch.save bytes, read back with ``weights_only=True``: torch's gather_object and
scatter_object_list would pad every rank's message to the largest one and hold world-size copies of it on rank
0 (where only some ranks hold anything, as the leaders of comm=hierarchical hold error-feedback residuals and
comm=diloco's node leaders their node's state, that is most of the memory).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["gather_to_rank0", "scatter_from_rank0"]



def _to_bytes(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(data: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


def gather_to_rank0(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0, in rank order (None elsewhere). Collective over the default group."""
    data = _to_bytes(obj)
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([data.numel()]), sizes, dst=0)
    if rank != 0:
        dist.send(data, dst=0)
        return None
    out = [obj]
    for src in range(1, world):
        buf = torch.empty(int(sizes[src]), dtype=torch.uint8)
        dist.recv(buf, src=src)
        out.append(_from_bytes(buf))
    return out


def scatter_from_rank0(objs: list[Any] | None) -> Any:
    """Rank r's ``objs[r]`` (``objs`` given on rank 0). Collective over the default group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    datas = [_to_bytes(o) for o in objs] if objs is not None else []
    size = torch.zeros(1, dtype=torch.int64)
    dist.scatter(size, [torch.tensor([d.numel()]) for d in datas] if rank == 0 else None, src=0)
    if rank == 0:
        for dst in range(1, world):
            dist.send(datas[dst], dst=dst)
        return objs[0]
    buf = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(buf, src=0)
    return _from_bytes(buf)
