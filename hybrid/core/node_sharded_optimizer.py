"""ZeRO-1 inside the node: each worker of a node holds and steps 1/g of the optimizer; nodes stay whole replicas.

With ``comm=sharded`` a DDP bucket's gradient is reduce-scattered inside the
node and each worker's shard all-reduced across nodes by the same-local-rank
workers of every node; plain ``sharded`` then all-gathers the gradients inside
the node so that every worker can run the whole optimizer. Here the gather
moves after the step (as Megatron-LM's distributed optimizer with one instance
per node, or DeepSpeed ZeRO++'s hpZ, do it):

1. backward: each bucket is averaged only where this worker owns it
   (:meth:`~hybrid.core.comm.base.Communicator.reduce_scatter_mean_`, through the
   DDP comm hook, overlapping with backward as before);
2. the global gradient norm (clipping, the non-finite check) is one all-reduce
   of this worker's sum of squares inside the node: every node holds the same
   averaged shards, so every rank of the job gets the same norm;
3. the wrapped optimizer (any elementwise ``torch.optim`` class) steps this
   worker's slices of the parameters (views into them) and holds state for those
   slices only (:class:`~hybrid.core.optimizer_shards.ShardLayout`);
4. the node all-gathers the updated parameters through the gradient buckets,
   whose gradients are spent by then, so no buffer is added.

The bytes on every link are those of ``comm=sharded``; the optimizer state per
worker is 1/g of DDP's. A node loses nothing when another node goes: it is a
whole replica. ``state_dict``/``load_state_dict`` take torch's own format with
whole tensors (node 0's workers gather to rank 0), so a checkpoint resumes under
``comm=ddp`` and the other way round, on any number of workers per node.

The shard follows DDP's buckets, which DDP rebuilds once, after the first
backward, in the order gradients became ready (hybrid's trainer settles them
before its first step). Where they change under a stepped optimizer, its
state moves to the new slices, one bucket's worth at a time.

Other communicators (hierarchical) average whole buckets, of which each worker
then uses its shard: the optimizer's memory and compute are still divided by g,
at the price of the parameter gather on top of the gradient traffic.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from hybrid.core.comm.base import Communicator
from hybrid.core.comm.ddp_hook import CommHookState, register_comm_hook
from hybrid.core.optimizer_shards import BucketShards, NoState, ShardLayout, check_elementwise, collective, first_rank

__all__ = ["SHARD_KEY", "NodeShardedOptimizer", "optimizer_state_bytes", "whole_state_of_shards"]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors this process's optimizer keeps between steps (its shard's, where it is sharded)."""
    if isinstance(optimizer, NodeShardedOptimizer):
        return optimizer.state_bytes()
    optimizer = getattr(optimizer, "optim", optimizer)  # torch's ZeroRedundancyOptimizer: this rank's part
    # FSDP2's state is DTensors, whose nbytes is the whole tensor's: count this rank's part.
    return sum(getattr(v, "to_local", lambda v=v: v)().nbytes
               for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))


class NodeShardedOptimizer(torch.optim.Optimizer):
    """``optimizer`` (a callable: parameters or param groups -> a ``torch.optim`` optimizer, e.g.
    ``functools.partial(torch.optim.AdamW, lr=1e-3)``), stepped on this worker's shard of the parameters.

    Use: build it over the model's parameters (or param groups) like the optimizer itself, wrap the model in
    DDP (``gradient_as_bucket_view=True``), :meth:`attach` it with the communicator, then per step:
    backward, optionally :meth:`clip_grad_norm_` / :meth:`grads_finite`, :meth:`step`, ``zero_grad``.
    ``param_groups`` are the whole model's, so LR schedulers work on it as on the optimizer it wraps.
    """

    def __init__(self, params: Iterable[Any], optimizer: Callable[[Any], torch.optim.Optimizer]) -> None:
        probe = optimizer([torch.zeros(1, requires_grad=True)])  # its class and filled-in defaults, no state
        check_elementwise(type(probe))
        self.optimizer_class = type(probe)
        self._factory = optimizer
        super().__init__(params, dict(probe.defaults))
        self._params = [p for group in self.param_groups for p in group["params"]]
        self._group_of = [i for i, group in enumerate(self.param_groups) for _ in group["params"]]
        self._number = {id(p): i for i, p in enumerate(self._params)}
        for i, p in enumerate(self._params):
            if not p.is_contiguous():
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) is not contiguous: a node-sharded "
                                 "optimizer steps views of flattened parameters")
        self.layout: ShardLayout | None = None  # this worker's shard, from the buckets of the first step
        self._comm: Communicator | None = None
        self._seen: dict[int, BucketShards] = {}  # the buckets of the backward in progress
        self._fresh = False  # _seen holds a backward the layout has not been checked against
        self._pending: dict[str, Any] | None = None  # a state dict loaded before the layout was known
        self._norm: tuple[torch.Tensor, bool] | None = None  # this step's (global gradient norm, finite)
        self.relayouts = 0  # times DDP's buckets changed under a stepped optimizer (its state moved)
        # Updates this worker's shard has taken: recovery in place tells from it whether the shard is a step ahead
        # of the last step the loop completed (its update done, the node's gather of the parameters not).
        self.updates = 0

    def state_bytes(self) -> int:
        """Bytes of state this worker's shard keeps between steps (0 before the first step)."""
        return self.layout.state_bytes() if self.layout is not None else 0

    @property
    def inner(self) -> torch.optim.Optimizer | None:
        """The wrapped optimizer over this worker's slices (None before the first step)."""
        return self.layout.inner if self.layout is not None else None

    # Wiring.

    def attach(self, model: DistributedDataParallel, communicator: Communicator) -> CommHookState:
        """Register the comm hook that averages ``model``'s buckets with ``communicator`` where this worker owns
        them, and learns their layout; returns the hook's state (``close()`` it at the end)."""
        if not model.gradient_as_bucket_view:
            raise ValueError("a node-sharded optimizer gathers parameters through DDP's gradient buckets: wrap the "
                             "model with DistributedDataParallel(..., gradient_as_bucket_view=True)")
        if communicator.topology.local_world_size > 1 and "intra" not in communicator.group_kinds:
            raise ValueError(f"comm={communicator.name} has no intra-node phase to gather parameters over: "
                             "use sharded or hierarchical")
        self._comm = communicator
        if self.layout is not None:
            # Attached again (comm=adaptive's switches build a new DDP and communicator): every communicator cuts
            # shards by the same rule (chunk_bytes, the node's workers), so the shard stays; it gathers over this one.
            if self.layout.comm.chunk_bytes != communicator.chunk_bytes:
                raise ValueError(f"a node-sharded optimizer's shards were cut in pieces of {self.layout.comm.chunk_bytes} "
                                 f"bytes; this communicator cuts {communicator.chunk_bytes}")
            self.layout.comm = communicator
        return register_comm_hook(model, communicator, observer=self)

    def bucket_ready(self, bucket: dist.GradBucket) -> None:
        """(DDP's backward) A bucket is about to be averaged: note where its gradients and parameters lie."""
        if bucket.index() == 0:
            self._seen = {}
        self._seen[bucket.index()] = BucketShards.of(bucket, self._number)
        self._fresh = True

    def _shard(self) -> ShardLayout:
        """This step's layout: the first backward's buckets give it (with a state dict loaded before); where DDP
        has since rebuilt its buckets, the state moves to the new slices."""
        if not self._fresh:
            if self.layout is None:
                raise RuntimeError("step() needs a backward through the model attached to this optimizer "
                                   "(NodeShardedOptimizer.attach) first")
            return self.layout
        self._fresh = False
        if sorted(self._seen) != list(range(len(self._seen))):
            raise RuntimeError(f"the last backward handed over buckets {sorted(self._seen)}, not 0..n-1")
        buckets = [self._seen[i] for i in range(len(self._seen))]
        if self.layout is not None and self.layout.signature == tuple(b.signature for b in buckets):
            for mine, now in zip(self.layout.buckets, buckets):
                mine.buffer = now.buffer
            return self.layout
        assert self._comm is not None
        layout = ShardLayout(buckets, self._comm, self._params, self._group_of, self.param_groups, self._factory)
        if self.layout is not None:
            def move(b: BucketShards, whole: dict[int, dict[str, Any]]) -> None:
                layout.load({p: whole.pop(p) for p in b.params if p in whole}, self._params, clear=False)
            self.layout.whole_state(to_all=True, on_bucket=move)
            self.relayouts += 1
        elif self._pending is not None and SHARD_KEY in self._pending:
            _load_shard(layout, self._pending[SHARD_KEY])
            self._pending = None
        elif self._pending is not None:
            layout.load(self._pending["state"], self._params)
            self._pending = None
        self.layout = layout
        return layout

    # The step.

    def _gradient_norm(self) -> tuple[torch.Tensor, bool]:
        """The global L2 norm of the averaged gradients, and whether they are all finite: one all-reduce of
        this worker's sum of squares over its node (every node holds the same shards, so every rank agrees)."""
        if self._norm is None:
            layout = self._shard()
            squares = torch.zeros(1, dtype=torch.float64)
            for owned in layout.owned:
                for s in owned:
                    squares += torch.linalg.vector_norm(layout.grad(s), dtype=torch.float64) ** 2
            group = layout.comm.groups.intra
            if group is not None and layout.comm.topology.local_world_size > 1:
                collective(layout.comm, lambda: dist.all_reduce(squares, group=group))
            total = squares.item()
            finite = math.isfinite(total)
            self._norm = (torch.tensor(math.sqrt(total) if finite else total, dtype=torch.float32), finite)
        return self._norm

    def grads_finite(self) -> bool:
        """Whether no averaged gradient holds inf or NaN; the same answer on every rank. Collective."""
        return self._gradient_norm()[1]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model's averaged gradients, from the shards:
        returns the total norm, scales this worker's slices as torch would scale the whole. Collective."""
        total, _ = self._gradient_norm()
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        layout = self._shard()
        for owned in layout.owned:
            for s in owned:
                layout.grad(s).mul_(coefficient)
        return total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Step this worker's slices with the averaged gradients, then gather the node's updated parameters.
        Collective over the node's workers."""
        if closure is not None:
            raise ValueError("a node-sharded optimizer takes no closure (it steps after one backward)")
        layout = self._shard()
        for mine, group in zip(layout.inner.param_groups, self.param_groups):  # the schedule's lr, a resume's
            mine.update({k: v for k, v in group.items() if k != "params"})
        for s, view in zip(layout.segments, layout.views):
            view.grad = layout.grad(s)
        layout.inner.step()
        self.updates += 1
        for view in layout.views:
            view.grad = None
        self._gather_parameters(layout)
        self._norm = None

    @staticmethod
    def _gather_parameters(layout: ShardLayout) -> None:
        """Every worker's updated slices to every worker of the node, through the (spent) gradient buckets."""
        for b, owned in zip(layout.buckets, layout.owned):
            for s in owned:
                layout.grad(s).copy_(b.tensors[s.position].view(-1)[s.start:s.start + s.numel])
        comm = layout.comm
        collective(comm, lambda: [comm.all_gather_shards_(b.buffer) for b in layout.buckets])
        for b in layout.buckets:
            for t, offset in zip(b.tensors, b.offsets):
                t.view(-1).copy_(b.buffer[offset:offset + t.numel()])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._norm = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "layout", None) is not None:
            raise RuntimeError("a node-sharded optimizer is sharded at its first step: add param groups before")
        super().add_param_group(param_group)

    # State dicts: torch's own format, whole tensors.

    def groups_state(self) -> list[dict[str, Any]]:
        """The param groups as torch's optimizer state_dict lists them (parameters by number), no state."""
        return self._groups_state()

    def _groups_state(self) -> list[dict[str, Any]]:
        numbers, groups = iter(range(len(self._params))), []
        for g in self.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [next(numbers) for _ in g["params"]]})
        return groups

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's optimizer state_dict of the whole model, complete on rank 0 (its node's workers gather it
        there; the other ranks get the param groups and no state). Over a node-only communicator (nodes that
        train apart, comm=diloco: :class:`~hybrid.core.comm.sharded.NodeCommunicator`), every node's leader gets its
        node's. Collective over the gathering node(s)."""
        if self.layout is None:  # not stepped yet: what was loaded, if anything (a peer's shard is no whole state)
            state = dict(self._pending["state"]) if self._pending is not None and "state" in self._pending else {}
        else:
            topo = self.layout.comm.topology
            whole = self.layout.whole_state(to_all=False) if topo.node == 0 else {}
            state = whole if topo.rank == first_rank(topo) else {}
        return {"state": state, "param_groups": self._groups_state()}

    def deferred_state_dict(self) -> tuple[dict[str, Any], Any]:
        """:meth:`state_dict` with the whole tensors left as placeholders on rank 0, and a
        :class:`~hybrid.app.state.streamed_save.Deferred` whose ``fill`` (collective over rank 0's node) gathers
        them one bucket at a time: rank 0 never holds the whole state. Elsewhere: no state, nothing to fill."""
        topo = self.layout.comm.topology if self.layout is not None else None
        if topo is None or topo.node != 0:
            return self.state_dict(), NoState()
        state, gathered = self.layout.deferred_state()
        state = state if topo.rank == first_rank(topo) else {}
        return {"state": state, "param_groups": self._groups_state()}, gathered

    def shard_state(self) -> dict[str, Any]:
        """This worker's shard as it holds it, for a peer with the same local rank (recovery in place): its
        slices (parameter, first element, length) and the wrapped optimizer's state of each, no collective.
        Every node's worker j holds the same slices, so a lost node loses no shard a survivor lacks. Before the
        first step: what was loaded. :meth:`load_state_dict` takes either."""
        if self.layout is None:
            return self._pending if self._pending is not None else {"state": {}, "param_groups": self._groups_state()}
        layout = self.layout
        shard = {"slices": [(s.param, s.start, s.numel) for s in layout.segments],
                 "state": [dict(layout.inner.state.get(view, {})) for view in layout.views]}
        return {SHARD_KEY: shard, "param_groups": self._groups_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's optimizer state_dict of the whole model (written by this class or by the optimizer it
        wraps, on any layout), of which each worker keeps its slices; or one worker's :meth:`shard_state`,
        which a worker of the same local rank takes whole."""
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved, self.param_groups)):
            raise ValueError(f"the optimizer state has groups of {[len(s['params']) for s in saved]} parameters, "
                             f"this optimizer {[len(g['params']) for g in self.param_groups]}")
        for group, s in zip(self.param_groups, saved):
            group.update({k: v for k, v in s.items() if k != "params"})
        if self.layout is None:
            self._pending = state_dict
        elif SHARD_KEY in state_dict:
            _load_shard(self.layout, state_dict[SHARD_KEY])
        else:
            self.layout.load(state_dict["state"], self._params)


# The entry of a state dict that holds one worker's shard (shard_state), not torch's whole-model state.
SHARD_KEY = "node_shard"


def _load_shard(layout: ShardLayout, shard: dict[str, Any]) -> None:
    """A peer's shard into ``layout``, whose slices must be the same: the same model, buckets and workers per
    node (recovery in place keeps all three)."""
    mine = [(s.param, s.start, s.numel) for s in layout.segments]
    theirs = [tuple(t) for t in shard["slices"]]
    if mine != theirs:
        raise RuntimeError(f"the optimizer shard received holds {len(theirs)} slices that differ from this "
                           f"worker's {len(mine)} (another model, bucket size or node size)")
    layout.inner.state.clear()
    for view, state in zip(layout.views, shard["state"], strict=True):
        if state:
            layout.inner.state[view] = {k: v.to(view.device) if torch.is_tensor(v) and v.dim() else v
                                        for k, v in state.items()}


def whole_state_of_shards(shards: list[dict[str, Any]], params: list[torch.Tensor]) -> dict[int, dict[str, Any]]:
    """torch's whole-tensor optimizer state (parameter number -> entries) of one node, from every one of its
    workers' :meth:`NodeShardedOptimizer.shard_state` (any order): each slice's entries laid at its place in its
    parameter, scalars (the step count) from any slice. ``params``: the model's parameters in the optimizer's
    order, for their shapes. What a checkpoint that kept a node's shards as they were resumes from, on any layout."""
    whole: dict[int, dict[str, Any]] = {}
    for shard in shards:
        if SHARD_KEY not in shard:  # written before its first step: what it was loaded with, whole
            for number, entries in shard.get("state", {}).items():
                whole.setdefault(int(number), dict(entries))
            continue
        part = shard[SHARD_KEY]
        for (number, start, numel), entries in zip(part["slices"], part["state"], strict=True):
            param = params[number]
            into = whole.setdefault(number, {})
            for key, value in entries.items():
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == numel and key != "step":
                    flat = into.get(key)
                    if flat is None:
                        flat = into[key] = torch.zeros(param.shape, dtype=value.dtype)
                    flat.view(-1)[start:start + numel].copy_(value)
                else:
                    into.setdefault(key, value)
    return whole
