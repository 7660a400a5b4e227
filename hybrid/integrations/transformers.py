"""``HybridCommCallback``: hybrid's two-level gradient reduce in a Hugging Face ``Trainer`` run on several processes.

The Trainer has no comm-hook option, and callbacks receive the unwrapped model; the DDP model it trains is
``trainer.model_wrapped``, made by ``accelerator.prepare`` just before ``on_train_begin``. So the callback
attaches there, to the Trainer that calls it, and closes in ``on_train_end``. ``gradient_accumulation_steps``
keeps working: accelerate runs the micro-batches between optimizer steps under DDP's ``no_sync``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from hybrid.core.attach import refuses_unknown_options
from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES
from hybrid.integrations.base import CommCallback

__all__ = ["HybridCommCallback"]

log = logging.getLogger(__name__)


class HybridCommCallback(CommCallback, TrainerCallback):
    """Average the Trainer's DDP gradients with hybrid's ``algorithm`` (hierarchical, sharded, flat, auto).

    It attaches to the Trainer whose ``train()`` calls it, or to ``trainer`` where given. During and after
    training, :attr:`attached` is the communicator and its hook (closed once training ends) and
    :attr:`counters` what travelled.
    """

    @refuses_unknown_options()
    def __init__(self, algorithm: str = "hierarchical", trainer: Trainer | None = None, *,
                 intra_backend: str = "auto", inter_backend: str = "auto", timeout_s: float = 300.0,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none") -> None:
        """Keep the options; the communicator is built when training begins.

        Args:
            algorithm: ``hierarchical``, ``sharded``, ``flat`` or ``auto`` (:func:`hybrid.attach`'s).
            trainer: the Trainer to attach to, where the callback is added after the Trainer is built
                (``trainer.add_callback(HybridCommCallback(trainer=trainer))``); default: the one calling it.
            intra_backend: the backend inside a node: ``auto`` (NCCL on CUDA, else gloo), ``gloo`` or ``nccl``.
            inter_backend: the backend between nodes, as ``intra_backend``.
            timeout_s: every collective's limit, seconds (> 0).
            chunk_bytes: the two-level algorithms' pipeline pieces, bytes (default 4 MiB).
            inter_compression: ``none``, ``bf16`` or ``fp16``: the inter-node hop only (two-level algorithms).
        """
        super().__init__(algorithm, intra_backend=intra_backend, inter_backend=inter_backend, timeout_s=timeout_s,
                         chunk_bytes=chunk_bytes, inter_compression=inter_compression)
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            log.warning("HybridCommCallback: one process, no gradients to average; training without it")
            return
        trainer = self.trainer or self._calling_trainer()
        attached = self._connect()  # a second train() with the same callback closes the first one's
        try:
            attached.attach(trainer.model_wrapped)
        except BaseException:
            self._close()
            raise

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _calling_trainer(self) -> Trainer:
        """The Trainer whose callback handler is calling this callback (the Trainer passes callbacks no Trainer)."""
        frame = inspect.currentframe()
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and self in candidate.callback_handler.callbacks:
                return candidate
            frame = frame.f_back
        raise RuntimeError("HybridCommCallback found no Trainer calling it: add it with "
                           "trainer.add_callback(HybridCommCallback(trainer=trainer))")
