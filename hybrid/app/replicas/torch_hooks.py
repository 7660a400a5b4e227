"""``comm=ddp comm.torch_hook=...``: torch's own DDP communication hooks, registered as a user would.

The compressed peers of hybrid's ``comm.inter_compression``: torch's
``bf16_compress_hook`` / ``fp16_compress_hook`` cast every bucket to 16 bits
for its one all-reduce (every hop, intra-node included, and no error
feedback), and ``powerSGD_hook`` sends a low-rank approximation with error
feedback after a warm-up of plain all-reduces. Nothing here re-implements
them: they are torch's functions and state, with hybrid's config keys.
torch refuses the bf16 hook without NCCL on CUDA (checked before start, in
:func:`hybrid.app.checks.check_devices`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.app.config import CommConfig

__all__ = ["register_torch_hook"]


def register_torch_hook(ddp: DDP, comm: CommConfig) -> Any:
    """Register ``comm.torch_hook`` on ``ddp`` (over the default process group); returns the hook's state
    (PowerSGD's), or None. ``none`` registers nothing: DDP's own all-reduce."""
    if comm.torch_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif comm.torch_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif comm.torch_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=comm.powersgd_rank,
            start_powerSGD_iter=comm.powersgd_warmup_steps, random_seed=0,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    elif comm.torch_hook != "none":
        raise ValueError(f"comm.torch_hook={comm.torch_hook!r} is not a torch hook hybrid registers")
    return None
