"""``auto``: pick flat, hierarchical or sharded per bucket size, from a cost model calibrated at start-up.

Which algorithm is fastest depends on the cluster (how slow the inter-node
link is next to the intra-node one, how many nodes) and on the message size
(latency-bound small buckets vs bandwidth-bound large ones), so no fixed
choice is right everywhere. Like a collective tuner (NCCL's, Open MPI's
"tuned" decision rules), ``auto`` decides per message size, but from
measurements of this job's own links rather than from a table:

1. At start-up every node times a rooted reduce inside the node and the node
   leaders time an all-reduce among themselves, at a few sizes
   (:func:`measure_levels`). The slowest rank's times are shared with every
   rank (one MAX all-reduce), and alpha (latency per step) and beta (seconds
   per byte) are fitted per level with :func:`hybrid.costmodel.fit_level`,
   the same least squares that calibrates the model from benchmark runs.
   Every rank thus holds the very same model. On equal nodes the ranks also
   run sharded's inter-node phase once (g concurrent all-reduces of 1/g of
   the largest size, one per local rank): how much faster that is than the
   leaders' single all-reduce, rounded to a whole number, is the number of
   NICs the node's traffic spreads over (``nics_per_node``); rounding keeps
   measurement noise from making sharded look faster over one NIC.
2. The first time a tensor of a given size (and dtype) is averaged, the cost
   model predicts each candidate algorithm (pipelined in this communicator's
   pieces) and the fastest is kept for that size: a :class:`Decision`.
   Equal predictions go to the simpler algorithm (flat, then hierarchical).
   Every rank decides alike, from the same model and the same sizes, so the
   collectives stay matched without talking about it.

On one node, or on nodes of one worker each, the two-level algorithms are
the same ring as flat or worse (the extra phases only cost), so ``auto`` is
flat there and measures nothing. With ``inter_compression``, hierarchical
and sharded send 16 bits per value across nodes, and the model prices their
inter-node phase accordingly; flat stays uncompressed.

Over one NIC per node sharded's concurrent cross-node all-reduces share the
link and cost what hierarchical's one does: equal predictions, so
hierarchical is chosen; sharded wins where the node's traffic spreads over
several NICs.

On NCCL every bucket goes through the DDP hook's communication thread (one
order of collectives across all groups on every rank, as NCCL needs for
communicators used side by side); on gloo, buckets auto sends flat keep
flat's direct path from backward, since gloo groups never wait on each other.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.comm.base import DEFAULT_CHUNK_BYTES, Communicator
from hybrid.comm.counters import PhaseCounters
from hybrid.comm.factory import ALGORITHMS, AUTO
from hybrid.comm.groups import CommGroups
from hybrid.costmodel import Level, Model, fit_level, predict
from hybrid.topology import Layout, Topology

__all__ = ["CALIBRATION_SIZES", "AutoCommunicator", "Decision", "auto_candidates", "auto_group_kinds",
           "measure_levels"]

# Small enough that latency dominates, and up to one pipeline piece: what every
# phase of the two-level algorithms moves per collective.
CALIBRATION_SIZES = (16 * 2**10, 512 * 2**10, 4 * 2**20)
CALIBRATION_REPEATS = 3

def auto_candidates(topology: Topology) -> tuple[str, ...]:
    """The algorithms worth comparing on ``topology``, simplest first."""
    if topology.nnodes == 1 or max(topology.node_sizes) == 1:
        return ("flat",)
    return ("flat", "hierarchical", "sharded") if topology.is_uniform else ("flat", "hierarchical")


def auto_group_kinds(topology: Topology) -> tuple[str, ...]:
    """The CommGroups kinds ``auto`` talks over on ``topology``: its candidates' together."""
    kinds: list[str] = []
    for name in auto_candidates(topology):
        kinds += [k for k in ALGORITHMS[name].group_kinds if k not in kinds]
    return tuple(kinds)


@dataclass(frozen=True)
class Decision:
    """What ``auto`` runs for tensors of ``nbytes``, and the predictions it chose from (seconds)."""

    nbytes: int
    dtype: str
    chosen: str
    predicted_s: dict[str, float]

    def as_dict(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "dtype": self.dtype, "chosen": self.chosen,
                "predicted_s": dict(self.predicted_s)}


def _timed(start_collective: Callable[[], Any], device: torch.device, repeats: int,
           before: Callable[[], Any] | None = None) -> float:
    """Median seconds of a collective (``start_collective()`` returns its Work) over ``repeats``, after one
    warm-up; each time waits for the Work and, on CUDA, for the device (NCCL's wait only orders streams).
    ``before`` runs ahead of each try, untimed."""
    times = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        start_collective().wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_levels(groups: CommGroups, device: torch.device | str = "cpu",
                   sizes: tuple[int, ...] = CALIBRATION_SIZES, repeats: int = CALIBRATION_REPEATS) -> Model:
    """Fit alpha and beta of the intra-node and inter-node level from timed collectives.

    Collective over every rank (it talks over ``groups.world``, ``intra`` and
    ``leaders``, and ``cross`` where built); every rank returns the same
    model. Intra: a reduce to the leader over the node's g ranks, (g-1) steps
    moving (g-1)/g of the bytes. Inter: an all-reduce among the n leaders,
    2(n-1) steps moving 2(n-1)/n of the bytes. These are the formulas
    :mod:`hybrid.costmodel` predicts with. NICs: see the module docstring.
    """
    topo = groups.topology
    if groups.world is None or groups.intra is None or (groups.leaders is None and topo.is_leader):
        raise ValueError("measure_levels needs the world, intra and leaders groups")
    if len(sizes) < 2:
        raise ValueError(f"calibration needs at least two sizes, got {sizes}")
    device = torch.device(device)
    buf = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    local, nnodes = topo.local_world_size, topo.nnodes
    intra = [0.0] * len(sizes)
    inter = [0.0] * len(sizes)
    for i, size in enumerate(sizes):
        piece = buf[: size // 4]
        if local > 1:
            intra[i] = _timed(lambda: dist.reduce(piece, dst=topo.leader, group=groups.intra, async_op=True),
                              device, repeats)
        if topo.is_leader and nnodes > 1:
            inter[i] = _timed(lambda: dist.all_reduce(piece, group=groups.leaders, async_op=True), device, repeats)
    # Sharded's inter phase at the largest size: every local rank's shard across nodes at once (each
    # repetition starts together, after a barrier, so the g all-reduces really share the node's links).
    spread = 0.0
    if groups.cross is not None and nnodes > 1 and local > 1:
        shard = torch.tensor_split(buf, local)[topo.local_rank]

        spread = _timed(lambda: dist.all_reduce(shard, group=groups.cross, async_op=True), device, repeats,
                        before=lambda: dist.barrier(group=groups.world))
    # The slowest rank's time per size and level, on every rank: one model everywhere.
    times = torch.tensor(intra + inter + [spread], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=groups.world)
    times_list = times.cpu().tolist()
    g, n = max(topo.node_sizes), nnodes
    intra_points = [(g - 1, (g - 1) / g * s, t) for s, t in zip(sizes, times_list[: len(sizes)])]
    inter_points = [(2 * (n - 1), 2 * (n - 1) / n * s, t) for s, t in zip(sizes, times_list[len(sizes):-1])]
    spread_s, leaders_s = times_list[-1], times_list[len(sizes) + sizes.index(max(sizes))]
    # How many links sharded's g all-reduces spread over, in whole NICs (at least 1, at most g).
    nics = min(g, max(1, round(leaders_s / spread_s))) if spread_s > 0 else 1
    return Model(fit_level(intra_points), fit_level(inter_points), nics)


class AutoCommunicator(Communicator):
    """Averages each tensor with the algorithm the calibrated cost model predicts fastest for its size.

    Build it on every rank at once (the calibration is collective), over
    groups of :func:`auto_group_kinds`. ``model`` skips the calibration (e.g.
    one fitted from ``hybrid.bench`` runs; it must be the same on every rank).
    """

    name = AUTO
    group_kinds = ()  # depends on the topology: auto_group_kinds()

    def __init__(self, groups: CommGroups, counters: PhaseCounters | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none",
                 model: Model | None = None, device: torch.device | str = "cpu") -> None:
        super().__init__(groups, counters, chunk_bytes)
        topo = groups.topology
        self.candidates = auto_candidates(topo)
        missing = [k for k in auto_group_kinds(topo) if k not in groups.kinds]
        if missing:
            raise ValueError(f"auto talks over the groups {list(auto_group_kinds(topo))}, but {missing} were not "
                             f"built: pass kinds=auto_group_kinds(topology) to CommGroups.build")
        self.inter_compression = inter_compression
        # Every member counts into this communicator's counters, under its own phase names.
        self.members: dict[str, Communicator] = {
            name: ALGORITHMS[name](groups, self.counters, chunk_bytes,
                                 "none" if name == "flat" else inter_compression)
            for name in self.candidates
        }
        self.calibration_s = 0.0
        if len(self.candidates) > 1 and model is None:
            start = time.perf_counter()
            model = measure_levels(groups, device)
            self.calibration_s = time.perf_counter() - start
        self.model = model
        # The model's layout: uneven nodes are priced as nodes of the largest size (the slowest node).
        self.layout = Layout.uniform(topo.nnodes, max(topo.node_sizes))
        self.decisions: dict[tuple[int, torch.dtype], Decision] = {}
        self._lock = threading.Lock()

    def decide(self, nbytes: int, dtype: torch.dtype = torch.float32) -> Decision:
        """The algorithm for tensors of ``nbytes`` and ``dtype`` (decided once per size, then reused)."""
        key = (nbytes, dtype)
        found = self.decisions.get(key)
        if found is not None:
            return found
        if self.model is None:
            decision = Decision(nbytes, str(dtype).replace("torch.", ""), "flat", {})
        else:
            predicted = {name: self._predict(name, nbytes, dtype) for name in self.candidates}
            chosen = min(self.candidates, key=predicted.__getitem__)  # first of equals: the simpler one
            decision = Decision(nbytes, str(dtype).replace("torch.", ""), chosen, predicted)
        with self._lock:
            return self.decisions.setdefault(key, decision)

    def _predict(self, name: str, nbytes: int, dtype: torch.dtype) -> float:
        assert self.model is not None
        model = self.model
        if name != "flat" and self.inter_compression != "none" and dtype in (torch.float32, torch.float64):
            # The inter-node phase carries 2 bytes per value instead of dtype's element size.
            wire = 2 / torch.empty(0, dtype=dtype).element_size()
            model = Model(model.intra, Level(model.inter.alpha_s, model.inter.beta_s_per_byte * wire),
                          model.nics_per_node)
        return predict(model, name, self.layout, nbytes, chunk_bytes=self.chunk_bytes)["total"]

    def member_for(self, tensor: torch.Tensor) -> Communicator:
        return self.members[self.decide(tensor.nbytes, tensor.dtype).chosen]

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable) -> None:
        self.member_for(flat)._sum_(flat, divisor, key)

    def starter_for(self, tensor: torch.Tensor) -> Callable[..., "torch.futures.Future[torch.Tensor]"] | None:
        if self.groups.intra_backend != "gloo" or self.groups.inter_backend != "gloo":
            return None  # NCCL: every bucket through the comm thread, one order across all groups
        return self.member_for(tensor).starter_for(tensor)

    def report(self) -> dict[str, Any]:
        """The calibration and every decision so far, JSON-ready (metrics.json's ``comm_auto``)."""
        model = None if self.model is None else {
            level: {"alpha_s": getattr(self.model, level).alpha_s,
                    "beta_s_per_byte": getattr(self.model, level).beta_s_per_byte,
                    "gbit_per_s": (8e-9 / getattr(self.model, level).beta_s_per_byte
                                   if getattr(self.model, level).beta_s_per_byte > 0 else None)}
            for level in ("intra", "inter")
        }
        with self._lock:
            decisions = sorted(self.decisions.values(), key=lambda d: d.nbytes)
        return {"candidates": list(self.candidates), "calibration_s": self.calibration_s, "model": model,
                "nics_per_node": None if self.model is None else self.model.nics_per_node,
                "decisions": [d.as_dict() for d in decisions]}
