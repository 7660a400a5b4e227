"""Pick a communicator by name (a fixed algorithm, or ``auto``), with the one documented fallback (sharded on
uneven nodes)."""

from __future__ import annotations

import logging

import torch

from hybrid.core.comm.auto import AutoCommunicator, auto_group_kinds
from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES, Communicator
from hybrid.core.comm.counters import PhaseCounters
from hybrid.core.comm.groups import CommGroups
from hybrid.core.comm.registry import ALGORITHM_CLASSES, AUTO, CHOOSABLE
from hybrid.core.topology import Topology

__all__ = ["group_kinds_for", "make_communicator"]

log = logging.getLogger(__name__)


def _resolve(algorithm: str, topology: Topology) -> str:
    if algorithm not in CHOOSABLE:
        raise ValueError(f"comm algorithm {algorithm!r} is not one of {', '.join(CHOOSABLE)}")
    return "hierarchical" if algorithm == "sharded" and not topology.is_uniform else algorithm


def group_kinds_for(algorithm: str, topology: Topology, shards_optimizer: bool = False) -> tuple[str, ...]:
    """The CommGroups kinds ``algorithm`` needs on ``topology`` (its fallback's, where it falls back);
    ``shards_optimizer``: as :func:`make_communicator`'s."""
    runs_as = _resolve(algorithm, topology)
    if runs_as == AUTO:
        return auto_group_kinds(topology, shards_optimizer)
    return ALGORITHM_CLASSES[runs_as].group_kinds


def make_communicator(
    algorithm: str, groups: CommGroups, counters: PhaseCounters | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none",
    device: torch.device | str = "cpu", shards_optimizer: bool = False,
) -> Communicator:
    """Build the named algorithm over ``groups``; ``inter_compression`` (none, bf16, fp16) applies to
    the inter-node phase of hierarchical and sharded (flat refuses it). ``auto`` calibrates its cost
    model here, with tensors on ``device`` (collective: every rank builds it at the same point), and, for a
    node-sharded optimizer (``shards_optimizer``), chooses only among the algorithms that can gather its
    updated parameters inside the node.

    ``sharded`` on nodes of unequal size falls back to ``hierarchical`` (its
    shards would not line up across nodes); the reason is logged and the
    returned object's ``name`` says which algorithm actually runs.
    """
    topo = groups.topology
    runs_as = _resolve(algorithm, topo)
    if runs_as != algorithm:
        log.warning(
            "sharded needs nodes of equal size; node sizes %s are uneven, so using hierarchical",
            list(topo.node_sizes),
        )
    if runs_as == AUTO:
        return AutoCommunicator(groups, counters, chunk_bytes, inter_compression, device=device,
                                shards_optimizer=shards_optimizer)
    return ALGORITHM_CLASSES[runs_as](groups, counters, chunk_bytes, inter_compression)
