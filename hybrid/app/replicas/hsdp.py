"""``comm=hsdp``: torch's own hierarchical data parallelism, FSDP2 on a (nodes, workers per node) mesh.

The peer a user would try before hybrid: ``fully_shard`` on a 2-D
DeviceMesh whose first dimension replicates across nodes and whose second
shards inside a node, so each step all-gathers parameters inside the node
(forward and backward), reduce-scatters gradients inside the node, and
all-reduces each shard across nodes: the traffic shape of ``comm=sharded``,
plus parameter and optimizer-state sharding (less memory, more intra-node
traffic). It is a baseline, built the way torch's documentation builds it,
not a hybrid communicator: ``bucket_mb`` and the backends do not apply
(FSDP2 communicates per sharded block, over the default backend).

Checkpoints go through torch's distributed state-dict API
(``torch.distributed.checkpoint.state_dict``, full state dicts gathered to
rank 0) into hybrid's ordinary checkpoint files, so the atomic writes,
manifests and resume of :mod:`hybrid.app.state.checkpoint` hold for it too.

Recovery in place (``cluster.recovery=in_place``) holds each rank's own shards
instead (:func:`held_shards`, no collective: its groups may be broken): shard
``j`` of every parameter and of its optimizer state lives on worker ``j`` of every
node, so a survivor keeps its own and a returning node's worker ``j`` receives
them from worker ``j`` of a live node. The next session builds the mesh and
``fully_shard`` over the new membership's groups (the shard layout inside a
node is unchanged) and copies the held shards in (:func:`load_held_shards`).
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from hybrid.app.components.data import BatchStream
from hybrid.app.components.losses import LossFn
from hybrid.app.replicas.base import SHARDED_STATE_KIND, accumulate, is_sharded, local_part
from hybrid.core.timeline import StepRecorder
from hybrid.core.topology import Topology

__all__ = ["HELD_SHARDS", "MESH_DIMS", "STATE_DICT_KIND", "HsdpReplica", "ShardedState", "full_state", "held_shards",
           "hsdp_mesh", "load_full_state", "load_held_shards", "shard_model", "shard_units"]

MESH_DIMS = ("replicate", "shard")
STATE_DICT_KIND = SHARDED_STATE_KIND  # recorded in this comm's checkpoints (see hybrid.app.replicas.base)
# The entry of an optimizer state held in place (:func:`held_shards`) that lists its sharded entries: it marks the
# state as this rank's shards, not a full state dict.
HELD_SHARDS = "hsdp_sharded_entries"


def hsdp_mesh(topology: Topology, device: torch.device, timeout_s: float) -> DeviceMesh:
    """The mesh of global ranks, one row per node: dimension 0 replicates across nodes, dimension 1 shards
    inside one. Built from the topology rather than assumed node-major, over groups made here so that their
    collectives fail after ``comm.timeout_s`` like every other comm's (DeviceMesh's own groups would take
    torch's backend default: 30 min on gloo). Collective."""
    if not topology.is_uniform:
        raise ValueError(f"comm=hsdp needs the same number of workers on every node, not {list(topology.node_sizes)}")
    rows = [list(node) for node in topology.nodes]
    timeout = timedelta(seconds=timeout_s)
    replicate, _ = dist.new_subgroups_by_enumeration([list(column) for column in zip(*rows)], timeout=timeout)
    shard, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout)
    return DeviceMesh.from_group([replicate, shard], device.type, mesh=torch.tensor(rows, dtype=torch.int),
                                 mesh_dim_names=MESH_DIMS)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks that get a ``fully_shard`` of their own (torchtitan's rule, generalised): the entries of
    every ``nn.ModuleList`` (transformer blocks); in a model without one, every leaf module with parameters
    (an MLP's Linears, a CNN's convs). A candidate that shares a parameter with a module outside it (tied
    embeddings) stays in the root's unit, which FSDP2 requires."""
    blocks = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
    candidates = blocks or [m for m in model.modules()
                            if m is not model and not list(m.children()) and list(m.parameters(recurse=False))]
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    units = []
    for unit in candidates:
        inside: dict[int, int] = {}
        for m in unit.modules():
            for p in m.parameters(recurse=False):
                inside[id(p)] = inside.get(id(p), 0) + 1
        if inside and all(owners[k] == n for k, n in inside.items()):
            units.append(unit)
    return units


def shard_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` each unit, then the root (what is left: embeddings, heads, tied weights). In place;
    the optimizer must be built afterwards, over the sharded parameters. Inner units first (the list is in
    pre-order), as FSDP2 requires of nested ones."""
    for unit in reversed(shard_units(model)):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Full (unsharded) model and optimizer state dicts on rank 0, on the CPU; empty elsewhere. Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                    optimizer_state: dict[str, Any]) -> None:
    """Shard full state dicts (every rank has them) into the model's and optimizer's shards. Collective."""
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))


def held_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's shards of the model's and optimizer's state, as plain local tensors (a DTensor's part on this
    rank; buffers and the step count whole), for recovery in place. No collective: FSDP2's state-dict hook
    registers the sharded parameters whatever a failed step left unsharded, and the optimizer's state is local."""
    model_part = {name: local_part(value).detach() for name, value in model.state_dict().items()}
    saved = optimizer.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    sharded: list[list[Any]] = []
    for index, entries in saved["state"].items():
        state[index] = {}
        for key, value in entries.items():
            if is_sharded(value):
                sharded.append([index, key])
            state[index][key] = local_part(value) if isinstance(value, torch.Tensor) else value
    return model_part, {"state": state, "param_groups": saved["param_groups"], HELD_SHARDS: sharded}


def load_held_shards(model: nn.Module, optimizer: torch.optim.Optimizer, model_part: dict[str, Any],
                     optimizer_part: dict[str, Any]) -> None:
    """Copy shards :func:`held_shards` took (on a worker of this local rank) into a model sharded over the new
    membership's mesh and its fresh optimizer. Raises where a shard's shape differs (another node size)."""
    with torch.no_grad():
        for name, value in model.state_dict().items():
            mine = local_part(value)
            held = model_part[name]
            if held.shape != mine.shape:
                raise ValueError(f"recovery in place: the held shard of {name} is {tuple(held.shape)}, this rank's "
                                 f"is {tuple(mine.shape)}: a shard moves only between workers of one local rank")
            mine.copy_(held)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {(index, key) for index, key in optimizer_part[HELD_SHARDS]}
    state = {index: {key: _shard_like(params[index], value) if (index, key) in sharded else value
                     for key, value in entries.items()}
             for index, entries in optimizer_part["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": optimizer_part["param_groups"]})


def _shard_like(param: Any, local: torch.Tensor) -> Any:
    """``local`` as this rank's part of a DTensor laid out as ``param`` (an optimizer moment of it)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


class ShardedState:
    """:class:`hybrid.app.replicas.base.StateAccess` for comm=hsdp: shard the model on ``mesh``; read and load
    state through torch's distributed state-dict API (full state dicts, rank 0's on the CPU)."""

    kind = STATE_DICT_KIND

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def prepare(self, model: nn.Module) -> nn.Module:
        return shard_model(model, self.mesh)

    def collect(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return full_state(model, optimizer)

    def load(self, model: nn.Module, optimizer: Any, model_state: dict[str, Any],
             optimizer_state: dict[str, Any]) -> None:
        """Full state dicts (a checkpoint's), or this rank's shards held in place (:func:`held_shards`)."""
        if HELD_SHARDS in optimizer_state:
            load_held_shards(model, optimizer, model_state, optimizer_state)
        else:
            load_full_state(model, optimizer, model_state, optimizer_state)

    def held(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's shards for recovery in place (:func:`held_shards`)."""
        return held_shards(model, optimizer)

    def extra(self) -> dict[str, Any]:
        return {}

    def deferred(self) -> None:
        return None


class HsdpReplica:
    """The loop's view of an FSDP2-sharded model: this rank's shards, which ranks of the same shard index
    on other nodes (the replicate dimension) hold bit for bit."""

    def __init__(self, model: nn.Module, stream: BatchStream, device: torch.device, loss_fn: LossFn,
                 shard_index: int, precision: str = "fp32", recorder: StepRecorder | None = None) -> None:
        self.module, self.stream, self.device, self.loss_fn = model, stream, device, loss_fn
        self.shard_index, self.precision = shard_index, precision
        # No gradient watch: FSDP2 writes each sharded gradient itself, after its reduce-scatter, so a
        # post-accumulate hook never fires; all of backward (its collectives included) counts as backward.
        self.recorder = recorder if recorder is not None else StepRecorder(())

    def forward_backward(self, accum: int) -> torch.Tensor:
        return accumulate(self.module, accum, self.stream, self.device, self.loss_fn, self.precision, self.recorder,
                          self._gradient_sync)

    @contextmanager
    def _gradient_sync(self, last: bool) -> Iterator[None]:
        """FSDP2's no_sync: only the last micro-step reduces gradients."""
        self.module.set_requires_gradient_sync(last)
        yield

    def end_step(self) -> None:
        pass

    def close(self) -> None:
        self.recorder.close()

    def local_models(self) -> list[nn.Module]:
        return [self.module]
