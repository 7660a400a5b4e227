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

from hybrid.core.attach import Attached, connect
from hybrid.core.comm import PhaseCounters

__all__ = ["HybridCommCallback"]

log = logging.getLogger(__name__)


class HybridCommCallback(TrainerCallback):
    """Average the Trainer's DDP gradients with hybrid's ``algorithm`` (hierarchical, sharded, flat, auto).

    ``comm_options`` are :func:`hybrid.attach`'s. Pass ``trainer`` where the callback is added after the
    Trainer is built (``trainer.add_callback(HybridCommCallback(trainer=trainer))``); otherwise it attaches
    to the Trainer whose ``train()`` calls it. During and after training, :attr:`attached` is the
    communicator and its hook (closed once training ends) and :attr:`counters` what travelled.
    """

    def __init__(self, algorithm: str = "hierarchical", trainer: Trainer | None = None, **comm_options: Any) -> None:
        self.algorithm = algorithm
        self.comm_options = comm_options
        self.trainer = trainer
        self.attached: Attached | None = None

    @property
    def counters(self) -> PhaseCounters | None:
        return None if self.attached is None else self.attached.counters

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            log.warning("HybridCommCallback: one process, no gradients to average; training without it")
            return
        trainer = self.trainer or self._calling_trainer()
        self._close()  # a second train() with the same callback
        self.attached = connect(self.algorithm, **self.comm_options)
        try:
            self.attached.attach(trainer.model_wrapped)
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

    def _close(self) -> None:
        if self.attached is not None:
            self.attached.close()
