"""Pick a communicator by name, with the one documented fallback (sharded on uneven nodes)."""

from __future__ import annotations

import logging

from hybrid.comm.base import DEFAULT_CHUNK_BYTES, Communicator
from hybrid.comm.counters import PhaseCounters
from hybrid.comm.flat import FlatCommunicator
from hybrid.comm.groups import CommGroups
from hybrid.comm.hierarchical import HierarchicalCommunicator
from hybrid.comm.sharded import ShardedCommunicator
from hybrid.topology import Topology

__all__ = ["ALGORITHMS", "group_kinds_for", "make_communicator"]

log = logging.getLogger(__name__)

ALGORITHMS: dict[str, type[Communicator]] = {
    cls.name: cls for cls in (FlatCommunicator, HierarchicalCommunicator, ShardedCommunicator)
}


def _resolve(algorithm: str, topology: Topology) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"comm algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return "hierarchical" if algorithm == "sharded" and not topology.is_uniform else algorithm


def group_kinds_for(algorithm: str, topology: Topology) -> tuple[str, ...]:
    """The CommGroups kinds ``algorithm`` needs on ``topology`` (its fallback's, where it falls back)."""
    return ALGORITHMS[_resolve(algorithm, topology)].group_kinds


def make_communicator(
    algorithm: str, groups: CommGroups, counters: PhaseCounters | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none",
) -> Communicator:
    """Build the named algorithm over ``groups``; ``inter_compression`` (none, bf16, fp16) applies to
    the inter-node phase of hierarchical and sharded (flat refuses it).

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
    return ALGORITHMS[runs_as](groups, counters, chunk_bytes, inter_compression)
