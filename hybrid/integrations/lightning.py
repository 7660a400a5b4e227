"""``HybridCommCallback``: hybrid's two-level gradient reduce in a PyTorch Lightning ``Trainer`` with ``strategy="ddp"``.

Why a callback and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning registers a strategy's hook only when
the root device is CUDA (silently nothing on CPU), and takes the hook's state in the constructor, before the
process group exists. The callback follows Lightning's life cycle instead: the communicator is built in
``setup`` (the process group exists, the model is not wrapped yet), registered on the DDP model in
``on_fit_start`` (Lightning has wrapped it), and closed in ``teardown`` or ``on_exception``.

Gradient accumulation (``accumulate_grad_batches``) keeps working: Lightning runs the micro-batches between
optimizer steps under DDP's ``no_sync``, so gradients travel on optimizer steps only.
"""

from __future__ import annotations

import logging
import warnings

try:
    import pytorch_lightning as pl
except ImportError:  # the unified package: pip install lightning
    import lightning.pytorch as pl

import torch.distributed as dist

from hybrid.integrations.base import CommCallback

__all__ = ["HybridCommCallback"]

log = logging.getLogger(__name__)


class HybridCommCallback(CommCallback, pl.Callback):
    """Average the DDP gradients of ``trainer.fit`` with hybrid's ``algorithm`` (hierarchical, sharded, flat, auto).

    The nodes are Lightning's own (``trainer.node_rank``). During and after ``fit``, :attr:`attached` is the
    communicator and its hooks (closed once ``fit`` ends) and :attr:`counters` what travelled (seconds,
    bytes, calls per phase). The constructor's arguments: :class:`hybrid.integrations.base.CommCallback`'s
    (``help(HybridCommCallback.__init__)`` lists them).
    """

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, pl.strategies.DDPStrategy):
            if trainer.world_size == 1 and not dist.is_initialized():
                log.warning("HybridCommCallback: one process, no gradients to average; training without it")
                return
            raise ValueError(f"HybridCommCallback needs strategy='ddp' (DDPStrategy), got {type(strategy).__name__}")
        if getattr(strategy, "_ddp_comm_hook", None) is not None:
            raise ValueError(f"HybridCommCallback and the strategy's ddp_comm_hook={strategy._ddp_comm_hook.__name__} both "
                             "want DDP's one comm hook: give DDPStrategy no ddp_comm_hook, or drop HybridCommCallback")
        self._connect(node_rank=trainer.node_rank)

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.attached is not None:
            self.attached.attach(trainer.strategy.model)

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._close()

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._close(timeout_s=1.0)


def __getattr__(name: str) -> type:
    """``HybridCommHook``, the callback's first name (it is a Callback, not a comm hook): still importable, with a
    DeprecationWarning, so that programs written against it keep running."""
    if name == "HybridCommHook":
        warnings.warn("hybrid.integrations.lightning.HybridCommHook is deprecated: it is HybridCommCallback now",
                      DeprecationWarning, stacklevel=2)
        return HybridCommCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
