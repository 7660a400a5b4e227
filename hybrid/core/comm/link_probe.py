"""Point-to-point bandwidth between every pair of node leaders, and the node whose links are slow.

A node with a degraded NIC (a bad cable, a port negotiated down, a
congested switch port) slows every ring it is in, and every member of the
ring waits alike, so phase times cannot say which node it is. Measuring each
pair of nodes on its own can: a node's links are no faster than its NIC.

The leaders meet in rounds of a round-robin tournament (the circle method:
``n - 1`` rounds for ``n`` nodes, one more with a bye when ``n`` is odd),
every node in at most one pair per round and the pairs of a round at once,
so no NIC carries two probes. In each pair, each side in turn sends
``nbytes`` and the other answers with one element; the sender's clock from
send to answer, best of ``repeats``, gives that direction's rate (one round
trip more than the transfer: negligible at megabytes, pessimistic on a very
fast link). Rank 0 of the leaders gathers all pairs and every leader gets
the same :class:`LinkReport`.

A node is named slow when its best link (its fastest peer's rate; a link is
the slower of its two directions) is below ``1 - margin`` of the median of
every node's best link. With two nodes both share their only link and
nothing can be named; it takes three.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybrid.core.topology import Topology
from hybrid.core.units import human_bytes

__all__ = ["DEFAULT_PROBE_BYTES", "LinkReport", "SLOW_LINK_MARGIN", "probe_links", "round_robin"]

DEFAULT_PROBE_BYTES = 4 * 2**20
SLOW_LINK_MARGIN = 0.25  # a node whose best link is below 75% of the nodes' median best is named


def round_robin(n: int) -> list[list[tuple[int, int]]]:
    """Rounds of disjoint pairs that meet every pair of ``0..n-1`` once (the circle method)."""
    players = list(range(n)) + ([None] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[i], players[m - 1 - i]) for i in range(m // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None])
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


@dataclass
class LinkReport:
    """Measured rates between node pairs, per direction, in Gbit/s."""

    nnodes: int
    nbytes: int
    gbps: dict[tuple[int, int], float]  # (sender node, receiver node) -> Gbit/s

    def link(self, a: int, b: int) -> float:
        """The pair's rate: the slower direction."""
        return min(self.gbps[(a, b)], self.gbps[(b, a)])

    def best(self, node: int) -> float:
        """``node``'s fastest link: what its NIC can at least do."""
        return max(self.link(node, other) for other in range(self.nnodes) if other != node)

    def slow_nodes(self, margin: float = SLOW_LINK_MARGIN) -> list[int]:
        """Nodes whose best link is below ``1 - margin`` of the median node's best; none with fewer than 3."""
        if self.nnodes < 3:
            return []
        bests = [self.best(n) for n in range(self.nnodes)]
        typical = statistics.median(bests)
        return [n for n, b in enumerate(bests) if b < (1 - margin) * typical]

    def table(self) -> list[str]:
        """One line per node: its links' rates (the slower direction) and its best one."""
        lines = [f"link probe ({human_bytes(self.nbytes)} each way, Gbit/s; a link is its slower direction):"]
        for n in range(self.nnodes):
            links = "  ".join(f"->{o}: {self.link(n, o):7.3f}" for o in range(self.nnodes) if o != n)
            lines.append(f"  node {n}: {links}   best {self.best(n):.3f}")
        slow = self.slow_nodes()
        if self.nnodes < 3:
            lines.append("  (two nodes share their only link: naming a slow one takes three or more)")
        elif slow:
            lines.append(f"  slow: node(s) {', '.join(map(str, slow))}: best link below "
                         f"{1 - SLOW_LINK_MARGIN:.0%} of the nodes' median best")
        else:
            lines.append(f"  no node's links are slower than {1 - SLOW_LINK_MARGIN:.0%} of the median node's")
        return lines

    def as_dict(self) -> dict:
        return {"nbytes": self.nbytes, "links_gbps": {f"{a}->{b}": r for (a, b), r in sorted(self.gbps.items())},
                "best_gbps": [self.best(n) for n in range(self.nnodes)] if self.nnodes > 1 else [],
                "slow_nodes": self.slow_nodes(), "margin": SLOW_LINK_MARGIN}


def _send_timed(payload: torch.Tensor, ack: torch.Tensor, peer: int, group: dist.ProcessGroup) -> float:
    start = time.perf_counter()
    dist.send(payload, dst=peer, group=group)
    dist.recv(ack, src=peer, group=group)
    if ack.is_cuda:
        torch.cuda.synchronize(ack.device)  # NCCL's recv returns when it is queued
    return time.perf_counter() - start


def _receive(payload: torch.Tensor, ack: torch.Tensor, peer: int, group: dist.ProcessGroup) -> None:
    dist.recv(payload, src=peer, group=group)
    dist.send(ack, dst=peer, group=group)


def probe_links(topology: Topology, group: dist.ProcessGroup | None, nbytes: int = DEFAULT_PROBE_BYTES,
                repeats: int = 2) -> LinkReport | None:
    """Measure every pair of nodes (collective over ``group``, the node leaders' group; the other ranks pass
    None and get None). Every leader returns the same report. The probe's tensors live where the group's
    backend takes them (this rank's GPU for NCCL)."""
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes={nbytes} and repeats={repeats} must be >= 1")
    if not topology.is_leader or group is None:
        return None
    n, me = topology.nnodes, topology.node
    leaders = topology.leaders  # global ranks, node order
    on_gpu = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    ack = torch.zeros(1, dtype=torch.float32, device=device)
    mine: dict[tuple[int, int], float] = {}
    for pairs in round_robin(n):
        for a, b in pairs:
            if me not in (a, b):
                continue
            peer = leaders[b if me == a else a]
            if me == a:  # warm the pair's connection up
                _send_timed(ack, ack, peer, group)
            else:
                _receive(ack, ack, peer, group)
            for sender, receiver in ((a, b), (b, a)):
                best = float("inf")
                for _ in range(repeats):
                    if me == sender:
                        best = min(best, _send_timed(payload, ack, peer, group))
                    else:
                        _receive(payload, ack, peer, group)
                if me == sender:
                    mine[(sender, receiver)] = payload.nbytes * 8 / best / 1e9
    everyone: list[dict | None] = [None] * n
    dist.all_gather_object(everyone, mine, group=group)
    return LinkReport(n, payload.nbytes, {k: v for part in everyone for k, v in (part or {}).items()})
