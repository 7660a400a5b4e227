"""comm=diloco in the trainer: each node a DiLoCo worker, its workers in step every step, nodes every H steps.

The node's workers run torch DDP over the node's own process group (DDP's
``process_group``), so their gradients are averaged over the fast intra-node
link every step and every worker of a node holds the same weights after each
step. Across nodes, :class:`hybrid.core.diloco.OuterSync` averages the
pseudo-gradients every ``comm.sync_every`` steps and applies the outer
optimizer (``comm.outer_optim``); the run ends with a sync, so every rank
finishes with the same model.

Between syncs the nodes hold different weights and inner optimizer states, so
a checkpoint keeps every node's (streamed into rank 0's file a piece at a time), with the
outer state once (the global weights, the outer optimizer's state and any exchange in flight: the same on
every node; with ``comm.inter=sharded`` a share from each of node 0's workers): a
resume anywhere inside an interval continues bitwise, in any layout. The checkpoint's
``model`` and ``optimizer`` are node 0's, so any comm can resume it (from node
0's weights) and DiLoCo can resume any comm's checkpoint (every node from its
weights). After an elastic change of the node count, node k continues from
the saved node k's state (a node beyond the saved ones from node 0's).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.app.components.data import BatchStream
from hybrid.app.components.losses import LossFn
from hybrid.app.config import CommConfig, outer_optimizer
from hybrid.app.replicas.base import PlainState, RankReplica
from hybrid.app.state.rank_parts import StreamedParts
from hybrid.core.comm import CommGroups, PhaseCounters
from hybrid.core.diloco import OuterSync
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer, whole_state_of_shards
from hybrid.core.timeline import StepRecorder
from hybrid.core.topology import Topology

__all__ = ["CHECKPOINT_KEY", "DilocoReplica", "DilocoState", "build_outer_sync", "diloco_group_kinds", "diloco_inter",
           "restore_node"]

CHECKPOINT_KEY = "diloco"


def diloco_inter(comm: CommConfig, topology: Topology) -> str:
    """How the nodes' pseudo-gradients travel: ``comm.inter``, with ``auto`` sharded where the nodes are of equal
    size (each worker then holds 1/g of the outer state and crosses its own link) and hierarchical elsewhere. One
    line where sharded cannot run."""
    if comm.inter == "auto":
        return "sharded" if topology.is_uniform else "hierarchical"
    if comm.inter == "sharded" and not topology.is_uniform:
        raise ValueError(f"comm.inter=sharded needs nodes of equal size; these have {list(topology.node_sizes)} "
                         "workers: use comm.inter=hierarchical or auto")
    return comm.inter


def diloco_group_kinds(comm: CommConfig, topology: Topology) -> tuple[str, ...]:
    """The groups comm=diloco talks over: the node's (DDP's, and the new weights spread inside it), and the
    leaders or the same-local-rank groups among nodes."""
    return ("intra", "leaders") if diloco_inter(comm, topology) == "hierarchical" else ("intra", "cross")


def build_outer_sync(model: nn.Module, groups: CommGroups, comm: CommConfig, counters: PhaseCounters,
                     in_place: bool = False) -> OuterSync:
    """The outer loop over ``model``'s parameters, as ``comm`` configures it; ``in_place``: each of its operations
    a transaction (recovery in place). Collective."""
    factory = outer_optimizer(comm).build()

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        built = factory(params)
        if not isinstance(built, torch.optim.Optimizer):
            raise ValueError(f"comm.outer_optim._target_ gave a {type(built).__name__}, not a torch.optim.Optimizer")
        return built

    return OuterSync(model.parameters(), groups, sync_every=comm.sync_every, outer_optimizer=outer,
                     inter=diloco_inter(comm, groups.topology), fragments=comm.fragments, compression=comm.inter_compression,
                     overlap=comm.overlap, overlap_steps=comm.overlap_steps, counters=counters, transactional=in_place)


def restore_node(saved: dict[str, Any] | None, node: int, model: nn.Module, optimizer: Any,
                 outer: OuterSync) -> str | None:
    """Load this node's part of a DiLoCo checkpoint and this rank's share of the outer state (``saved``: its
    :data:`CHECKPOINT_KEY` entry; None: the run is fresh or resumes another comm's checkpoint, whose weights
    every node already holds). The inner optimizer's state is loaded without its param groups, which the
    resume has set (a changed LR policy). Returns a status line where the node count changed."""
    if not saved:
        return None
    nodes = saved["nodes"]
    entry = nodes[node] if node < len(nodes) else nodes[0]
    if node != 0:
        model.load_state_dict(entry["model"])
        state = entry["optimizer"]["state"]
        if "optimizer_shards" in entry:  # its workers' shards as they held them (comm.shard_optimizer)
            params = [p for group in optimizer.param_groups for p in group["params"]]
            state = whole_state_of_shards(entry["optimizer_shards"], params)
        groups = optimizer.groups_state() if isinstance(optimizer, NodeShardedOptimizer) else \
            optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    shares = saved.get("outer_shares")  # absent: a checkpoint whose nodes each held the whole outer state
    outer.load_state_dict(entry["outer"] if shares is None else {**entry["outer"], "shares": shares})
    return None if node < len(nodes) else (f"diloco: node {node} is new since the checkpoint ({len(nodes)} "
                                            "node(s)); it continues from node 0's weights")


class DilocoState(PlainState):
    """Checkpoints of comm=diloco: every node's model and inner optimizer state (from its leader) and the outer
    state once (from node 0's workers that hold a share of it), streamed into rank 0's file a piece at a time
    (:mod:`hybrid.app.state.rank_parts`: rank 0 never holds another rank's part whole); node 0's as the
    checkpoint's ``model`` and ``optimizer``, so it also resumes as a plain checkpoint. Set ``outer`` before the
    first save."""

    in_diloco = True  # what recovery in place reads of the state's kind (hybrid.app.state.in_place)

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.outer: OuterSync | None = None
        self._parts: StreamedParts | None = None
        self._gathered: Any = None  # comm.shard_optimizer: node 0's inner state, gathered into the file

    def collect(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.outer is None:
            raise RuntimeError("DilocoState.outer is not set: build the OuterSync before the first checkpoint")
        outer = self.outer.state_dict()  # collective where an exchange is in flight: on every rank
        share = outer.pop("shares")[0]
        topology = self.topology
        shard, self._gathered = None, None
        if isinstance(optimizer, NodeShardedOptimizer):
            # No worker gathers its node's inner state: node 0's goes into the file one piece at a time as torch's
            # whole state (the checkpoint's optimizer, which any comm resumes); every other node's workers send
            # their shards as they hold them (restore_node lays them whole again).
            if topology.node == 0:
                inner, self._gathered = optimizer.deferred_state_dict()
            else:
                inner, shard = {"state": {}, "param_groups": optimizer.groups_state()}, optimizer.shard_state()
        else:
            inner = optimizer.state_dict()
        node = {"model": model.state_dict(), "optimizer": inner, "outer": outer}
        holds_share = topology.node == 0 and (self.outer.owners is not None or topology.is_leader)
        mine = {"node": node if topology.is_leader else None, "share": share if holds_share else None,
                "shard": shard, "at": topology.node}
        self._parts = StreamedParts(mine if topology.is_leader or holds_share or shard is not None else None)
        return node["model"], node["optimizer"]

    def extra(self) -> dict[str, Any]:
        entries = self._parts.entries() if self._parts is not None else None
        if entries is None:
            return {}
        nodes = [dict(e["node"]) for e in entries if e["node"] is not None]  # copies: the entries stream as they are
        for e in entries:  # rank order: a node's shards in local-rank order
            if e.get("shard") is not None:
                nodes[e["at"]].setdefault("optimizer_shards", []).append(e["shard"])
        return {CHECKPOINT_KEY: {"nodes": nodes, "outer_shares": [e["share"] for e in entries if e["share"] is not None]}}

    def deferred(self) -> Any:
        if self._gathered is None:
            return self._parts
        return InOrder([self._gathered, self._parts])


class InOrder:
    """Several :class:`hybrid.app.state.streamed_save.Deferred` filled one after the other, on every rank alike."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = [p for p in parts if p is not None]

    def placeholders(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.placeholders()]

    def fill(self, write: Callable[[torch.Tensor, torch.Tensor, int], None] | None) -> None:
        for p in self.parts:
            p.fill(write)


class DilocoReplica(RankReplica):
    """This rank's model under DDP over its node, and the outer loop among nodes after each inner step.

    Ranks that must hold the same bits (``shard_index``): every rank after a sync of the whole model, else the
    ranks of one node. Logs, at each outer step: ``diloco/outer_steps``, ``diloco/pseudo_grad_norm`` and rank
    0's loss just before the sync and at the step after it (``diloco/loss_before_sync``, ``loss_after_sync``),
    through ``log_scalars(step, values)`` (the run's TensorBoard metrics)."""

    def __init__(self, ddp: DDP, stream: BatchStream, device: torch.device, loss_fn: LossFn, outer: OuterSync,
                 topology: Topology, start_step: int, max_steps: int,
                 log_scalars: Callable[[int, dict[str, float]], None], precision: str = "fp32",
                 recorder: StepRecorder | None = None, compile: bool = False) -> None:
        super().__init__(ddp, stream, device, loss_fn, precision, recorder, compile)
        self.outer, self.node, self.log_scalars = outer, topology.node, log_scalars
        self.inner_step, self.max_steps = start_step, max_steps
        self._loss: torch.Tensor | None = None
        self._after_sync = False

    @property
    def shard_index(self) -> int:  # type: ignore[override]
        return 0 if self.outer.identical_everywhere else self.node

    def forward_backward(self, accum: int) -> torch.Tensor:
        loss = self._loss = super().forward_backward(accum)
        if self._after_sync:
            self.log_scalars(self.inner_step + 1, {"diloco/loss_after_sync": float(loss)})
            self._after_sync = False
        return loss

    def end_step(self) -> None:
        self.inner_step += 1
        before = self.outer.syncs
        # The last step ends with a sync of whatever moved (OuterSync.finish): every rank ends with the same model.
        self.outer.step(self.inner_step, final=self.inner_step == self.max_steps)
        if self.outer.syncs != before:
            values = {"diloco/outer_steps": float(self.outer.syncs),
                      "diloco/pseudo_grad_norm": self.outer.last_pseudo_grad_norm}
            if self._loss is not None:
                values["diloco/loss_before_sync"] = float(self._loss)
            self.log_scalars(self.inner_step, values)
            self._after_sync = True

    def summary(self) -> dict[str, Any]:
        """What metrics.json says of the outer loop."""
        outer = self.outer
        return {"diloco": {"sync_every": outer.sync_every, "fragments": len(outer.fragments), "inter": outer.inter,
                           "overlap": outer.overlap, "overlap_steps": outer.delay, "compression": outer.compression, "outer_steps": outer.syncs,
                           "bytes_per_sync": outer.bytes_per_sync,
                           "inter_bytes_per_step": outer.bytes_per_sync / outer.sync_every,
                           "last_pseudo_grad_norm": outer.last_pseudo_grad_norm}}

