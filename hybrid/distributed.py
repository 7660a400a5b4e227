"""Join the job's default process group from torchrun's environment, and leave it."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid.topology import WorkerEnv

__all__ = ["init_distributed", "shutdown_distributed"]


def init_distributed(timeout_s: float = 300.0) -> WorkerEnv:
    """Initialise the default group (gloo on CPU; gloo for CPU + nccl for CUDA tensors).

    The default group carries only start-up exchanges and the training loop's
    own collectives; gradients travel on :class:`hybrid.comm.CommGroups`.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
    env = WorkerEnv.from_env()
    if dist.is_initialized():
        return env
    backend = "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return env


def shutdown_distributed() -> None:
    """Destroy every process group; safe to call on the failure path too."""
    if dist.is_initialized():
        dist.destroy_process_group()
