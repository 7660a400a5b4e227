"""Which node every rank is on, from whatever the launcher said, for programs hybrid did not start.

torchrun exports ``GROUP_RANK``; Slurm ``SLURM_NODEID``; Ray Train and Kubernetes jobs ``NODE_RANK``;
Lightning knows its ``trainer.node_rank``; a launcher that starts one task per GPU may say nothing at
all. Each rank writes down what it sees (:func:`local_report`), the reports are exchanged once, and
:func:`topology_from_reports`, which is pure, picks the first source every rank has, in this order:

1. a node rank the program passes explicitly (Lightning's ``trainer.node_rank``);
2. ``GROUP_RANK`` (torchrun, torch elastic), ``SLURM_NODEID`` (Slurm), ``NODE_RANK`` (Ray Train,
   Kubernetes, Lightning's own launcher);
3. the host name: ranks that share one are one node.

Inside a node, ranks are ordered by ``LOCAL_RANK`` (or ``SLURM_LOCALID``) where every rank of the node
has one, else by global rank. A source that cannot name nodes is refused with the numbers that show it:
a node whose local ranks repeat (``NODE_RANK=0`` exported on every machine). A node that spans several
host names is only warned about (one container per GPU has a host name of its own). By host name, one
machine is one node, however many launchers started ranks on it (their local ranks may repeat).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hybrid.core.topology import RankInfo, Topology, build_topology

__all__ = ["EXPLICIT", "HOSTNAME", "LOCAL_RANK_VARIABLES", "NODE_VARIABLES", "RankReport", "local_report",
           "topology_from_reports"]

log = logging.getLogger(__name__)

EXPLICIT = "node_rank"  # the source name of a node rank the program passed itself
HOSTNAME = "hostname"
# (variable, who sets it), in the order they are preferred
NODE_VARIABLES: tuple[tuple[str, str], ...] = (
    ("GROUP_RANK", "torchrun / torch elastic"),
    ("SLURM_NODEID", "Slurm"),
    ("NODE_RANK", "Ray Train, Kubernetes, Lightning"),
)
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")


@dataclass(frozen=True)
class RankReport:
    """What one rank knows about where it runs: its node ids by source, its host, its local rank if told."""

    rank: int
    host: str
    node_ids: dict[str, int] = field(default_factory=dict)  # source -> node id
    local_rank: int | None = None


def _integer(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer") from None


def local_report(rank: int, environ: Mapping[str, str] | None = None, host: str | None = None,
                 node_rank: int | None = None) -> RankReport:
    """This rank's :class:`RankReport`, read from ``environ`` (default: the process's environment)."""
    env = os.environ if environ is None else environ
    ids = {} if node_rank is None else {EXPLICIT: int(node_rank)}
    for name, _ in NODE_VARIABLES:
        value = _integer(env, name)
        if value is not None:
            ids[name] = value
    local = next((v for v in (_integer(env, name) for name in LOCAL_RANK_VARIABLES) if v is not None), None)
    return RankReport(rank=rank, host=socket.gethostname() if host is None else host, node_ids=ids,
                      local_rank=local)


def _source(reports: Sequence[RankReport]) -> str:
    """The first source that every rank reports."""
    for name in (EXPLICIT, *(n for n, _ in NODE_VARIABLES)):
        if all(name in r.node_ids for r in reports):
            return name
    return HOSTNAME


def topology_from_reports(rank: int, reports: Sequence[RankReport]) -> tuple[Topology, str]:
    """The topology every rank's reports describe, and the source that named the nodes.

    Pure: every rank calls it on the same gathered reports and gets the same answer (or the same error).
    """
    world = len(reports)
    if sorted(r.rank for r in reports) != list(range(world)):
        raise ValueError(f"reports from ranks {sorted(r.rank for r in reports)}: expected 0..{world - 1} once each")
    source = _source(reports)
    key = (lambda r: r.host) if source == HOSTNAME else (lambda r: r.node_ids[source])
    members: dict[object, list[RankReport]] = {}
    for report in sorted(reports, key=lambda r: r.rank):
        members.setdefault(key(report), []).append(report)
    # Numbered nodes keep the launcher's order; host names are numbered by their lowest rank.
    order = sorted(members, key=(lambda k: members[k][0].rank) if source == HOSTNAME else (lambda k: k))
    infos = []
    for index, node_key in enumerate(order):
        node = members[node_key]
        _check_one_node(source, node_key, node)
        local = [r.local_rank for r in node]
        if sorted(x for x in local if x is not None) != list(range(len(node))):
            local = list(range(len(node)))  # not every rank says, or not 0..n-1: order by global rank
        infos.extend(RankInfo(r.rank, index, lr, len(node)) for r, lr in zip(node, local))
    return build_topology(rank, infos), source


def _check_one_node(source: str, node_key: object, node: list[RankReport]) -> None:
    """Refuse a node variable that put the same local rank twice on one node; warn where a node spans host names."""
    where = f"{source}={node_key}" if source != HOSTNAME else f"host {node_key!r}"
    hosts = sorted({r.host for r in node})
    if len(hosts) > 1:
        log.warning("%s puts ranks %s on one node, but they run on hosts %s: their intra-node collectives cross "
                    "the network unless those hosts share a machine", where, [r.rank for r in node], hosts)
    local = [r.local_rank for r in node if r.local_rank is not None]
    if source != HOSTNAME and len(local) != len(set(local)):
        raise ValueError(f"{where} puts ranks {[r.rank for r in node]} on one node, but their local ranks "
                         f"{[r.local_rank for r in node]} repeat: {source} does not name nodes here; set "
                         "GROUP_RANK, SLURM_NODEID or NODE_RANK per node")
