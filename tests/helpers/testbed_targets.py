"""Rank code for tests/test_testbed.py."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid.runtime.distributed import init_distributed, shutdown_distributed


def timed_allreduce(nbytes: int, repeats: int) -> dict:
    """All-reduce ``nbytes`` over all ranks a few times; report where this rank was and how long it took."""
    env = init_distributed(timeout_s=120)
    try:
        tensor = torch.ones(nbytes // 4)
        dist.all_reduce(tensor)  # connect first
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(tensor)
        elapsed = time.perf_counter() - start
        # What a program in the node sees of it, as under ``ip netns exec``: its own devices in /sys, the
        # testbed's hosts file, its mounts not the machine's.
        return {"rank": env.rank, "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
                "netns": os.readlink("/proc/self/ns/net"), "mntns": os.readlink("/proc/self/ns/mnt"),
                "sys_net": sorted(os.listdir("/sys/class/net")), "hosts": Path("/etc/hosts").read_text(),
                "seconds": elapsed}
    finally:
        shutdown_distributed()
