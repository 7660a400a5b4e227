"""The optimizer (any ``torch.optim`` class, from ``optim._target_``) and hybrid's LR schedule: linear warm-up,
then cosine decay or constant."""

from __future__ import annotations

import inspect
import math
from typing import Any, Iterable

import torch

from hybrid.app.config import OptimConfig
from hybrid.app.targets import Component, ComponentError
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer
from hybrid.core.optimizer_shards import check_elementwise

__all__ = ["SHARDINGS", "build_optimizer", "build_scheduler", "check_optimizer", "lr_factor", "parameter_groups"]


SHARDINGS = ("none", "node", "job")


def parameter_groups(model: torch.nn.Module, no_decay: bool) -> list[Any]:
    """What the optimizer is built over: the model's parameters, or with ``optim.no_decay`` two param groups as
    nanoGPT splits them. Tensors of two or more dimensions (matmul and convolution weights, embeddings) keep the
    optimizer's ``weight_decay``; the others (biases, LayerNorm/BatchNorm/RMSNorm weights) get none, since
    decaying a bias or a norm's scale towards 0 only fights the normalisation. Model order within each group, an
    empty group left out; frozen parameters stay in, as in the one-group case, so both cases hold the same
    parameters in the same order per group."""
    params = list(model.parameters())
    if not no_decay:
        return params
    groups = [{"params": [p for p in params if p.dim() >= 2]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(params: Iterable[Any], cfg: OptimConfig, shard: str = "none",
                    ) -> torch.optim.Optimizer:
    """``optim._target_`` (a ``_partial_`` optimizer class) called with the parameters (or param groups:
    :func:`parameter_groups`); ``shard``
    (``comm.shard_optimizer``): ``node``: wrapped so that each worker of a node steps its shard only (attached to
    the DDP model once that exists: :class:`~hybrid.core.node_sharded_optimizer.NodeShardedOptimizer`); ``job``:
    torch's ``ZeroRedundancyOptimizer`` over every rank of the default group (comm=ddp's reference)."""
    if shard not in SHARDINGS:
        raise ValueError(f"shard={shard!r} is not one of {', '.join(SHARDINGS)}")
    if shard == "node":
        return NodeShardedOptimizer(list(params), cfg.optimizer.build())
    if shard == "job":
        from torch.distributed.optim import ZeroRedundancyOptimizer  # loaded only by runs that use it

        factory = cfg.optimizer.build()
        return ZeroRedundancyOptimizer(list(params), optimizer_class=factory.func, **factory.keywords)
    optimizer = cfg.optimizer.build(list(params))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ComponentError(f"optim._target_={cfg.optimizer.target} gave a {type(optimizer).__name__}, not a "
                             "torch.optim.Optimizer (an optimizer class needs _partial_: true)")
    return optimizer


def check_optimizer(optimizer: Component, shard: bool = False) -> None:
    """What :func:`build_optimizer` would refuse, found without building one (constructing the first optimizer
    imports torch's compiler stack, over a second that every ``hybrid.train`` call would pay up front): the
    target must be an optimizer class, take these arguments, and get numbers where its defaults are numbers.
    ``optimizer``: the ``optim`` node's, or another optimizer node's (``comm.outer_optim``). ``shard``
    (``comm.shard_optimizer``): the class must also be one whose update is elementwise."""
    factory = optimizer.build()  # a functools.partial of the class: nothing constructed yet
    cls, args, kwargs = getattr(factory, "func", factory), getattr(factory, "args", ()), getattr(factory, "keywords", {})
    key = optimizer.key
    where = f"{key}._target_={optimizer.target}"
    if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
        raise ComponentError(f"{where} is not a torch.optim.Optimizer class")
    if shard:
        try:
            check_elementwise(cls)
        except ValueError as exc:
            raise ComponentError(str(exc)) from None
    signature = inspect.signature(cls)
    try:
        signature.bind([], *args, **kwargs)
    except TypeError as exc:
        raise ComponentError(f"{where}: TypeError: {exc}") from exc
    for name, value in kwargs.items():
        default = signature.parameters[name].default if name in signature.parameters else None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if isinstance(default, (int, float)) and not isinstance(default, bool) and not number:
            raise ComponentError(f"{key}.{name}={value!r} is not a number ({cls.__name__}'s default is {default!r})")
    lr = kwargs.get("lr")
    if isinstance(lr, (int, float)) and not lr > 0:
        raise ComponentError(f"{key}.lr={lr!r} must be > 0")


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of the optimizer's learning rate for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))
