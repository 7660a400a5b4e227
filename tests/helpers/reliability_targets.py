"""Worker entry points of tests/test_reliability.py (importable by module name, as workers need)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybrid.app.replicas.base import ReplicaDivergence, check_replicas
from hybrid.runtime.distributed import init_distributed, shutdown_distributed

_LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net/tcp* write them


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def listening_sockets() -> dict[str, Any]:
    """Every listening TCP socket of this node's job (its agent and workers: one session), with address."""
    import torch.distributed as dist

    init_distributed(60)
    try:
        dist.barrier()  # every rank is up: all gloo pairs and the store are listening now
        session = os.getsid(0)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        ours = set()
        for pid in pids:
            try:
                if os.getsid(pid) == session:
                    ours |= _socket_inodes(pid)
            except OSError:
                continue
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in ours:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    listening.append({"address": address, "port": int(port, 16),
                                      "loopback": address in _LOOPBACK})
        dist.barrier()
        return {"rank": dist.get_rank(), "listening": listening}
    finally:
        shutdown_distributed()


def diverge_and_check(bad_rank: int) -> str:
    """Build identical replicas, nudge one rank's weights by one ulp, run the guard."""
    init_distributed(60)
    try:
        import torch.distributed as dist

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        check_replicas(model, step=1)  # identical: passes
        if dist.get_rank() == bad_rank:
            with torch.no_grad():
                w = model[1].weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
        try:
            check_replicas(model, step=2)
        except ReplicaDivergence as exc:
            return str(exc)
        return "no divergence detected"
    finally:
        shutdown_distributed()
