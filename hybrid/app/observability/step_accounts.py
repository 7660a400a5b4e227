"""Per-rank step accounting: how long each rank computed and waited, and which node the others wait for.

Every process accounts each of its steps locally (a
:class:`~hybrid.core.timeline.StepTimes`: the loop's parts, each phase, each
phase's part not hidden behind backward). Nothing is exchanged per step: at
each log step every process hands its rows of the interval to rank 0 in one
small all-gather over the default group (a few hundred bytes per rank and
step), the only exchange this adds, at a point where rank 0 already logs.

Rank 0 then asks, per step, whether one node stands out: the node whose
slowest rank computed (data, forward, backward up to its last gradient,
optimizer) longest, if that is more than ``1 + straggler_margin`` times the
median of the other nodes'. The others wait for it: their time shows up as
``comm_wait`` and exposed phases. ``straggler_steps`` such steps in a row
(the same node) print a warning naming the node, the part of its step that
grew most, and the phase the others wait in. The run's ``ranks`` (medians
per rank over the last :data:`KEEP_STEPS` steps, the invocation's first step
left out: warm-up) and ``slowest_node`` go to metrics.json; per-node medians go to
TensorBoard at each log step (``nodes/<i>/...``).

Nodes that share a host are not judged against each other by contention.
Simulated nodes on one machine (a local launch, the testbed, two torchrun
agents on one host) share its CPUs: when its workers outnumber its cores the
scheduler runs some of them later than others, and a node's compute can take
2.5x another's for steps in a row with nothing wrong with the node (the
default 2x2 on 2 cores). That slowness is the host's, not the node's, so a
node can be named only where it could be slow on its own: it has no other
node on its host (host: ``socket.gethostname()``, gathered once at start), or
it is given less CPU than another node there (``cluster.testbed.cpu_quota``,
a cgroup limit: node 1 at a quarter of node 0's CPU is named, at 3.4-7.7x).
:func:`nameable_nodes` says which; metrics.json's ``straggler_candidates``
lists them. Per-node compute still goes to TensorBoard for every node. A
wider margin where nodes share a host would not separate the two: contention
reached 2.5x on the default run, while a testbed node at a quarter CPU with
one worker showed as little as 1.96x.

A node slow on the network is not found here: a ring's every member waits
alike for its slowest link. The link probe names such a node
(:mod:`hybrid.core.comm.link_probe`).
"""

from __future__ import annotations

import math
import socket
import statistics
import time
from collections import deque
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from hybrid.app.observability.metrics import Metrics
from hybrid.core.comm import PHASES, comm_error
from hybrid.core.timeline import COMPUTE, SEGMENTS, StepTimes
from hybrid.core.topology import Topology

__all__ = ["KEEP_STEPS", "StepAccounts", "find_straggler", "nameable_nodes"]

KEEP_STEPS = 1000  # per process, on rank 0: the medians' window
_COLUMNS = ("rank", "node", "step", "step_s", *SEGMENTS, *PHASES, *(f"{p}_exposed" for p in PHASES))
_AT = {name: i for i, name in enumerate(_COLUMNS)}


def nameable_nodes(hosts: Mapping[int, str], cpus: Mapping[int, float | None] | None = None) -> set[int]:
    """The nodes a straggler warning may name: those alone on their host, and those given less CPU than another
    node on theirs (``cpus``: per node its CPU limit, None or missing: none). Nodes sharing a host with equal
    shares of it are slowed alike by its contention; one of them standing out says nothing about the node."""
    cpus = cpus or {}

    def limit(node: int) -> float:
        given = cpus.get(node)
        return math.inf if given is None else float(given)

    return {n for n, host in hosts.items()
            if not any(m != n and h == host for m, h in hosts.items())
            or any(m != n and h == host and limit(n) < limit(m) for m, h in hosts.items())}


def find_straggler(per_node: dict[int, dict[str, float]], margin: float,
                   nameable: set[int] | None = None) -> dict[str, Any] | None:
    """The node whose compute exceeds the other nodes' median compute by more than ``margin`` (a share),
    as ``{"node", "ratio", "segment"}`` (``segment``: the compute part that exceeds the others' most), or None.
    ``nameable`` (default: every node): the nodes that may be named (:func:`nameable_nodes`); where the slowest
    node is not among them, its excess is its host's contention, and nobody is named.

    ``per_node``: per node, seconds per :data:`~hybrid.core.timeline.COMPUTE` part and ``compute`` (their sum)."""
    if len(per_node) < 2:
        return None
    node = max(per_node, key=lambda n: per_node[n]["compute"])
    if nameable is not None and node not in nameable:
        return None
    others = [v for n, v in per_node.items() if n != node]
    typical = statistics.median(v["compute"] for v in others)
    if typical <= 0 or per_node[node]["compute"] <= (1 + margin) * typical:
        return None
    segment = max(COMPUTE, key=lambda s: per_node[node][s] - statistics.median(v[s] for v in others))
    return {"node": node, "ratio": per_node[node]["compute"] / typical, "segment": segment}


def _hosts(node: int) -> dict[int, str]:
    """Per node, the name of the host it runs on: every process's, gathered once (a node's first process's)."""
    mine = (node, socket.gethostname())
    gathered: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
    hosts: dict[int, str] = {}
    for n, host in gathered:
        hosts.setdefault(int(n), host)
    return hosts


def _node_compute(rows: list[list[float]]) -> dict[int, dict[str, float]]:
    """Per node, from one step's rows (one per process): its slowest process's compute parts."""
    nodes: dict[int, dict[str, float]] = {}
    for row in rows:
        parts = {s: row[_AT[s]] for s in COMPUTE}
        parts["compute"] = sum(parts.values())
        node = int(row[_AT["node"]])
        if node not in nodes or parts["compute"] > nodes[node]["compute"]:
            nodes[node] = parts
    return nodes


class StepAccounts:
    """This process's step rows, exchanged at log steps; rank 0 keeps everyone's and judges stragglers."""

    def __init__(self, topology: Topology, metrics: Metrics, margin: float, warn_after: int,
                 cpus: Sequence[float] | None = None) -> None:
        """Collective (the hosts' names, once): every process builds its accounts at the same point.
        ``cpus``: per node, its CPU limit (the testbed's ``cpu_quota``), or None: no limits."""
        self.topology, self.rank, self.node = topology, topology.rank, topology.node
        self.metrics, self.margin, self.warn_after = metrics, margin, warn_after
        self.hosts = _hosts(self.node)
        limits = dict(enumerate(cpus)) if cpus is not None and len(cpus) == len(self.hosts) else None
        self.nameable = nameable_nodes(self.hosts, limits)
        self._pending: list[list[float]] = []
        self._kept: dict[int, deque[list[float]]] = {}  # rank 0: per process rank, its last rows
        self._streak: tuple[int | None, int] = (None, 0)  # the node standing out, for how many steps in a row
        self._first_step: int | None = None  # this invocation's first step (warm-up; a resumed run's is not 1)

    def add(self, step: int, step_s: float, times: StepTimes) -> None:
        self._first_step = step if self._first_step is None else self._first_step
        self._pending.append([self.rank, self.node, step, step_s, *(times.segments[s] for s in SEGMENTS),
                              *(times.phases[p] for p in PHASES), *(times.exposed[p] for p in PHASES)])

    def exchange(self) -> None:
        """Collective (every process, at the same step): rank 0 receives the interval's rows of everyone."""
        if not self._pending:  # alike everywhere: every process runs the same steps
            return
        mine = torch.tensor(self._pending, dtype=torch.float64).reshape(-1, len(_COLUMNS))
        self._pending = []
        gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        start = time.perf_counter()
        try:
            dist.all_gather(gathered, mine)
        except RuntimeError as exc:  # a peer gone, a timeout: one line that says where, as a comm phase's
            raise comm_error("step accounts' exchange", self.topology, exc, start) from exc
        if dist.get_rank() != 0:
            return
        for rows in gathered:
            for row in rows.tolist():
                self._kept.setdefault(int(row[_AT["rank"]]), deque(maxlen=KEEP_STEPS)).append(row)
        steps = [rows.tolist() for rows in gathered]
        for k in range(mine.shape[0]):
            self._judge([per_process[k] for per_process in steps])
        self._log_nodes(steps, int(mine[-1, _AT["step"]]) if mine.shape[0] else 0)

    def _judge(self, rows: list[list[float]]) -> None:
        """One step of every process: extend or end the straggler streak; warn when it reaches warn_after."""
        found = find_straggler(_node_compute(rows), self.margin, self.nameable)
        node = None if found is None else found["node"]
        count = self._streak[1] + 1 if node is not None and node == self._streak[0] else 1
        self._streak = (node, count)
        if found is not None and count == self.warn_after:
            others = [r for r in rows if int(r[_AT["node"]]) != node]
            # The phase they wait in (exposed after their backward); DDP's own all-reduce has none: comm_wait.
            waits = {p: statistics.median(r[_AT[f"{p}_exposed"]] for r in others) for p in PHASES}
            waited = max(waits, key=waits.__getitem__) if max(waits.values()) > 0 else "comm_wait"
            self.metrics.status(
                f"warning: node {node} is the slowest for {count} steps in a row (step {int(rows[0][_AT['step']])}): "
                f"its compute takes {found['ratio']:.1f}x the other nodes' median (most of the excess in "
                f"{found['segment']}); the others wait for it in {waited}")

    def _log_nodes(self, steps: list[list[list[float]]], step: int) -> None:
        """TensorBoard: per node, the interval's median compute and comm_wait of its slowest process (ms)."""
        if not steps or not steps[0]:
            return
        per_step = [_node_compute([p[k] for p in steps]) for k in range(len(steps[0]))]
        waits: dict[int, list[float]] = {}
        for per_process in steps:
            for row in per_process:
                waits.setdefault(int(row[_AT["node"]]), []).append(row[_AT["comm_wait"]])
        values = {}
        for node in per_step[0]:
            values[f"nodes/{node}/compute_ms"] = statistics.median(s[node]["compute"] for s in per_step) * 1e3
            values[f"nodes/{node}/comm_wait_ms"] = statistics.median(waits[node]) * 1e3
        self.metrics.scalars(step, values)

    def summary(self) -> dict[str, Any]:
        """Rank 0: ``ranks`` (medians per process, this invocation's first step left out) and ``slowest_node``
        (with its detail), judged on those medians as each step is judged."""
        ranks, medians = [], []
        for rank in sorted(self._kept):
            rows = [r for r in self._kept[rank] if r[_AT["step"]] > (self._first_step or 1)] or list(self._kept[rank])
            row = [rank, rows[0][_AT["node"]], 0, *(statistics.median(r[i] for r in rows)
                                                    for i in range(_AT["step_s"], len(_COLUMNS)))]
            medians.append(row)
            ranks.append({"rank": rank, "node": int(row[_AT["node"]]), "steps": len(rows),
                          "step_s": row[_AT["step_s"]], "compute_s": sum(row[_AT[s]] for s in COMPUTE),
                          **{f"{s}_s": row[_AT[s]] for s in SEGMENTS},
                          "phase_s": {p: row[_AT[p]] for p in PHASES},
                          "exposed_s": {p: row[_AT[f"{p}_exposed"]] for p in PHASES}})
        found = find_straggler(_node_compute(medians), self.margin, self.nameable)
        return {"ranks": ranks, "slowest_node": None if found is None else found["node"],
                "slowest_node_detail": found, "straggler_margin": self.margin,
                "straggler_candidates": sorted(self.nameable),
                "node_hosts": [self.hosts[n] for n in sorted(self.hosts)]}
