"""``hybrid.attach``: the two-level communicator inside any DDP program, whoever launched it.

A program that already trains with torch DDP (its own torchrun script, Lightning's ``DDPStrategy``, the
Hugging Face Trainer, ``accelerate.prepare``) keeps everything it has and adds one call after wrapping
its model::

    ddp = DistributedDataParallel(model)
    with hybrid.attach(ddp, algorithm="hierarchical") as comm:   # or flat, sharded, auto
        train(ddp)
    print(comm.counters.snapshot())

It is the very hook hybrid's own trainer registers (:func:`hybrid.core.comm.register_comm_hook`), over
groups built from the live default process group. What it adds is what a program started by someone
else needs: the nodes found from whatever the launcher said (:mod:`hybrid.core.nodes`), one exchange
that also makes sure every rank asked for the same thing, and refusals in one line, on every rank
alike, before any gradient moves.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hybrid.core.comm import (
    CommGroups,
    CommHookState,
    Communicator,
    PhaseCounters,
    group_kinds_for,
    make_communicator,
    register_comm_hook,
)
from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES
from hybrid.core.comm.options import check_comm_options
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer
from hybrid.core.nodes import RankReport, local_report, topology_from_reports
from hybrid.core.topology import Topology

__all__ = ["Attached", "CommOptions", "attach", "connect"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class CommOptions:
    """What every rank must agree on: the algorithm and how it talks."""

    algorithm: str = "hierarchical"
    intra_backend: str = "auto"
    inter_backend: str = "auto"
    timeout_s: float = 300.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    inter_compression: str = "none"

    def __post_init__(self) -> None:
        check_comm_options(**asdict(self))


class Attached:
    """A communicator over this job's ranks and the DDP models that average their gradients with it.

    ``communicator`` (its ``name`` says which algorithm runs), ``counters`` (seconds, bytes and calls per
    phase: ``counters.snapshot(reset=True)``), ``topology`` (who is on which node) and ``node_source``
    (which launcher variable said so). Use as a context manager, or call :meth:`close` when training ends.
    """

    def __init__(self, communicator: Communicator, node_source: str) -> None:
        self.communicator = communicator
        self.node_source = node_source
        self.hooks: list[CommHookState] = []
        self._closed = False

    @property
    def counters(self) -> PhaseCounters:
        return self.communicator.counters

    @property
    def topology(self) -> Topology:
        return self.communicator.topology

    def attach(self, model: DistributedDataParallel) -> CommHookState:
        """Let ``model`` (one more DDP model: a GAN's other half, a teacher) average with this communicator too."""
        if self._closed:
            raise RuntimeError("this communicator is closed: call hybrid.attach again to train on")
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"hybrid.attach needs a torch DistributedDataParallel model (what DDP(model), Lightning's "
                            f"DDPStrategy, the Trainer and accelerate.prepare make), got {type(model).__name__}")
        if getattr(model, "_comm_hooks", None) or _has_builtin_hook(model):
            raise ValueError("this DDP model already has a comm hook (register_comm_hook, a strategy's ddp_comm_hook "
                             "or accelerate's comm_hook): DDP takes one; drop the other or attach a fresh model")
        state = register_comm_hook(model, self.communicator)
        self.hooks.append(state)
        return state

    def shard_optimizer(self, model: DistributedDataParallel, optimizer: Callable[[Any], torch.optim.Optimizer],
                        params: Iterable[Any] | None = None) -> NodeShardedOptimizer:
        """Average ``model``'s gradients with this communicator and step ``optimizer`` sharded inside each node
        (ZeRO-1 within the node, docs/memory.md): each worker holds and steps its shard of the optimizer's state,
        then the node gathers the updated weights. ``optimizer``: an elementwise ``torch.optim`` class with its
        arguments (``functools.partial(torch.optim.AdamW, lr=1e-3)``), built over ``params`` (default: the
        model's parameters; param groups work). Step the returned optimizer in place of your own:
        ``backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()``; its ``state_dict`` is torch's
        whole-tensor one, complete on rank 0 (collective over rank 0's node)."""
        if self._closed:
            raise RuntimeError("this communicator is closed: call hybrid.connect again to train on")
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"shard_optimizer needs a torch DistributedDataParallel model, got {type(model).__name__}")
        sharded = NodeShardedOptimizer(model.parameters() if params is None else params, optimizer)
        self.hooks.append(sharded.attach(model, self.communicator))
        return sharded

    def close(self, timeout_s: float = 10.0) -> None:
        """Serve what is queued (waiting at most ``timeout_s``), stop the thread, destroy the groups. A model
        still hooked refuses its next backward; the default process group stays the program's."""
        if self._closed:
            return
        self._closed = True
        for state in self.hooks:
            state.close(timeout_s)
        if dist.is_initialized():
            self.communicator.groups.destroy()

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Attached({self.communicator.name}, {self.topology.describe()}, nodes from {self.node_source}, "
                f"{len(self.hooks)} model(s))")


def _has_builtin_hook(model: DistributedDataParallel) -> bool:
    """Whether torch's built-in hook (register_builtin_comm_hook, accelerate's comm_hook) is registered."""
    try:
        return bool(model._get_ddp_logging_data().get("comm_hook"))
    except (AttributeError, RuntimeError):
        return False


def refuses_unknown_options(name: str | None = None) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function whose keyword-only parameters are comm options: a keyword it does not take is refused
    in one line that lists those it does (``unknown comm option(s) bucket_mb: hybrid.attach takes ...``), not
    with Python's bare ``unexpected keyword argument``. The signature stays the function's, for type checkers
    and :func:`inspect.signature`. ``name``: what takes them (None: a constructor's class, its first argument's)."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        parameters = inspect.signature(func).parameters
        keywords = [p.name for p in parameters.values() if p.kind is p.KEYWORD_ONLY]

        @functools.wraps(func)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            unknown = sorted(set(kwargs) - set(parameters))
            if unknown:
                taker = name or type(args[0]).__name__
                raise TypeError(f"unknown comm option(s) {', '.join(unknown)}: {taker} takes {', '.join(keywords)}")
            return func(*args, **kwargs)

        return checked

    return decorate


@refuses_unknown_options("hybrid.attach")
def connect(algorithm: str = "hierarchical", *, intra_backend: str = "auto", inter_backend: str = "auto",
            timeout_s: float = 300.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none",
            node_rank: int | None = None, counters: PhaseCounters | None = None) -> Attached:
    """Build a communicator over the default process group's ranks, with no model yet.

    Use it where the model does not exist yet or is not a DDP model of yours alone (a callback, the optimizer
    sharded inside the node: ``hybrid.connect("sharded").shard_optimizer(ddp, optimizer)``); then
    :meth:`Attached.attach` each DDP model. Collective: every rank calls it at the same point, with the
    same options.

    Args:
        algorithm: ``hierarchical``, ``sharded``, ``flat`` or ``auto`` (see :func:`attach`).
        intra_backend: the backend inside a node: ``auto`` (NCCL on CUDA, else gloo), ``gloo`` or ``nccl``.
        inter_backend: the backend between nodes, as ``intra_backend``.
        timeout_s: every collective's limit, seconds (> 0).
        chunk_bytes: the two-level algorithms' pipeline pieces, bytes (default 4 MiB).
        inter_compression: ``none``, ``bf16`` or ``fp16``: the inter-node hop only (two-level algorithms).
        node_rank: this rank's node, where the program knows it better than the environment (Lightning's
            ``trainer.node_rank``); default: found from the launcher's variables.
        counters: where the seconds, bytes and calls per phase go (default: new ones).

    Returns:
        The :class:`Attached` communicator; close it (or use it as a context manager) when training ends.
    """
    opts = CommOptions(algorithm, intra_backend, inter_backend, timeout_s, chunk_bytes, inter_compression)
    if not dist.is_initialized():
        raise RuntimeError("hybrid.attach needs the default process group: call torch.distributed.init_process_group "
                           "first (torchrun scripts do; Lightning, the Trainer and accelerate do it for you)")
    reports = _exchange(local_report(dist.get_rank(), node_rank=node_rank), opts)
    topology, source = topology_from_reports(dist.get_rank(), reports)
    log.info("hybrid: %s, nodes from %s", topology.describe(), source)
    groups = CommGroups.build(topology, opts.intra_backend, opts.inter_backend, opts.timeout_s,
                              kinds=group_kinds_for(opts.algorithm, topology))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in (groups.intra_backend, groups.inter_backend) \
        else torch.device("cpu")
    communicator = make_communicator(opts.algorithm, groups, counters or PhaseCounters(), opts.chunk_bytes,
                                     opts.inter_compression, device=device)
    return Attached(communicator, source)


@refuses_unknown_options("hybrid.attach")
def attach(models: DistributedDataParallel | Iterable[DistributedDataParallel], algorithm: str = "hierarchical", *,
           intra_backend: str = "auto", inter_backend: str = "auto", timeout_s: float = 300.0,
           chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none", node_rank: int | None = None,
           counters: PhaseCounters | None = None) -> Attached:
    """Average the gradients of ``models`` with hybrid's ``algorithm``: the one call a DDP program adds after
    wrapping its model(s), whoever launched it. Collective: every rank calls it with the same options.

    Args:
        models: one torch ``DistributedDataParallel`` model over the default process group, or several that
            share one communicator (a GAN's two halves).
        algorithm: ``hierarchical`` (reduce to each node's leader, all-reduce among leaders, broadcast),
            ``sharded`` (reduce-scatter, shards across nodes, all-gather), ``flat`` (one ring) or ``auto``
            (per bucket size, from a calibrated cost model).
        intra_backend: the backend inside a node: ``auto`` (NCCL on CUDA, else gloo), ``gloo`` or ``nccl``.
        inter_backend: the backend between nodes, as ``intra_backend``.
        timeout_s: every collective's limit, seconds (> 0).
        chunk_bytes: the two-level algorithms' pipeline pieces, bytes (default 4 MiB).
        inter_compression: ``none``, ``bf16`` or ``fp16``: the inter-node hop only (two-level algorithms).
        node_rank: this rank's node, where the program knows it better than the environment.
        counters: where the seconds, bytes and calls per phase go (default: new ones).

    Returns:
        The :class:`Attached` communicator with its hooks; ``with hybrid.attach(...) as comm:`` closes it.
    """
    candidates = [models] if isinstance(models, torch.nn.Module) else list(models)
    for model in candidates:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"hybrid.attach needs a torch DistributedDataParallel model (what DDP(model), Lightning's "
                            f"DDPStrategy, the Trainer and accelerate.prepare make), got {type(model).__name__}")
        if dist.is_initialized():
            ranks = dist.get_process_group_ranks(model.process_group)
            if ranks != list(range(dist.get_world_size())):
                raise ValueError(f"the DDP model averages over the process group of ranks {ranks}, not the default "
                                 f"world of {dist.get_world_size()}: hybrid.attach serves DDP over the default group")
    handle = connect(algorithm, intra_backend=intra_backend, inter_backend=inter_backend, timeout_s=timeout_s,
                     chunk_bytes=chunk_bytes, inter_compression=inter_compression, node_rank=node_rank,
                     counters=counters)
    try:
        for model in candidates:
            handle.attach(model)
    except BaseException:
        handle.close()
        raise
    return handle


def _exchange(report: RankReport, opts: CommOptions) -> list[RankReport]:
    """Every rank's report, once every rank is seen to have asked for the same options (else the same error
    on every rank).

    Over a gloo group of its own with the options' timeout, so a rank that never comes fails the others
    within ``timeout_s`` (the default group's may be 30 minutes), and on any device.
    """
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=opts.timeout_s))
    try:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (report, asdict(opts)), group=group)
    finally:
        dist.destroy_process_group(group)
    mine = asdict(opts)
    for name in mine:
        values = [theirs[name] for _, theirs in gathered]
        if len(set(values)) > 1:
            by_value: dict[Any, list[int]] = {}
            for rank, value in enumerate(values):
                by_value.setdefault(value, []).append(rank)
            said = "; ".join(f"{value!r} on ranks {ranks}" for value, ranks in by_value.items())
            raise ValueError(f"ranks disagree on {name}: {said}; every rank must attach with the same options")
    return [r for r, _ in gathered]
