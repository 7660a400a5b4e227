"""The loss of a batch: the ``loss`` component applied to the model's output, or the loss the model returns.

``loss`` is any callable ``(output, target) -> scalar tensor`` (``conf/loss/*.yaml``
names it by ``_target_``; the default is :func:`cross_entropy`). A model whose
output carries its own ``.loss`` (Hugging Face models given ``labels``) needs
none: that loss is used as it is. Inputs that are a mapping (a dataset returning
``{"input_ids": ..., "labels": ...}``) are passed as keyword arguments, as
Hugging Face models take them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["LossFn", "batch_loss", "cross_entropy", "move_to"]

LossFn = Callable[[Any, Any], torch.Tensor]


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of class scores against class ids, per position for sequence models (``(B, T, V)``
    scores against ``(B, T)`` ids)."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def move_to(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` (a tensor, or mappings / sequences of them) on ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: move_to(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(v, device, non_blocking) for v in batch)
    return batch


def batch_loss(model: nn.Module, x: Any, y: Any, loss_fn: LossFn) -> torch.Tensor:
    """The loss of one batch: forward ``x`` through ``model``, then the model's own loss or ``loss_fn``."""
    output = model(**x) if isinstance(x, Mapping) else model(x)
    own = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(own, torch.Tensor):
        return own
    return loss_fn(output, y)
