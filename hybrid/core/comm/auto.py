"""``auto``: pick flat, hierarchical or sharded per bucket size, from a cost model calibrated at start-up.

Which algorithm is fastest depends on the cluster (how slow the inter-node
link is next to the intra-node one, how many nodes) and on the message size
(latency-bound small buckets vs bandwidth-bound large ones), so no fixed
choice is right everywhere. Like a collective tuner (NCCL's, Open MPI's
"tuned" decision rules), ``auto`` decides per message size, but from
measurements of this job's own links rather than from a table:

1. At start-up every candidate's phases are timed as that algorithm runs
   them, at a few sizes (:func:`measure_levels`): hierarchical's reduce and
   broadcast inside the node and its leaders' all-reduce, flat's all-reduce
   over every rank, sharded's all-to-all (with the sum) and broadcasts
   inside the node and its g concurrent cross-node all-reduces. The slowest
   rank's times are shared with every rank (one MAX all-reduce), and alpha
   (latency per step) and beta (seconds per byte) are fitted per phase
   level with :func:`hybrid.core.costmodel.fit_level`, the same least squares
   that calibrates the model from benchmark runs. Every rank thus holds the
   very same model. Timing each algorithm's own collectives matters on real
   libraries: gloo's all-to-all does not cost what its rooted reduce does,
   nor g all-reduces sharing a link what one does, and a model that derives
   one algorithm's cost from another's picks the wrong one on small buckets
   (experiments/RESULTS.md, "Choosing the algorithm per bucket size").
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

On NCCL every bucket goes through the groups' ordered stream (one
order of collectives across all groups on every rank, as NCCL needs for
communicators used side by side); on gloo, buckets auto sends flat keep
flat's direct path from backward, since gloo groups never wait on each other.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.core.comm.base import DEFAULT_CHUNK_BYTES, Communicator
from hybrid.core.comm.compression import InterCompressor
from hybrid.core.comm.counters import PhaseCounters
from hybrid.core.comm.groups import CommGroups
from hybrid.core.comm.link_probe import LinkReport, probe_links
from hybrid.core.comm.registry import ALGORITHM_CLASSES, AUTO
from hybrid.core.comm.sharded import ShardedCommunicator
from hybrid.core.costmodel import Model, fit_level, predict
from hybrid.core.topology import Layout, Topology

__all__ = ["CALIBRATION_SIZES", "MODEL_LEVELS", "AutoCommunicator", "Decision", "auto_candidates", "auto_group_kinds",
           "fit_calibration", "measure_levels"]

# Small enough that latency dominates, and up to one pipeline piece: what every
# phase of the two-level algorithms moves per collective.
CALIBRATION_SIZES = (16 * 2**10, 512 * 2**10, 4 * 2**20)
CALIBRATION_REPEATS = 5
# The Model's levels, in the order reports list them.
MODEL_LEVELS = ("intra", "inter", "flat", "sharded_intra", "sharded_inter")


def auto_candidates(topology: Topology, shards_optimizer: bool = False) -> tuple[str, ...]:
    """The algorithms worth comparing on ``topology``, simplest first. ``shards_optimizer``: for a node-sharded
    optimizer (comm.shard_optimizer), which gathers the updated parameters inside the node, only those with an
    intra-node phase: flat has none (hierarchical then stands alone where flat would)."""
    if topology.nnodes == 1 or max(topology.node_sizes) == 1:
        candidates: tuple[str, ...] = ("flat",)
    else:
        candidates = ("flat", "hierarchical", "sharded") if topology.is_uniform else ("flat", "hierarchical")
    if shards_optimizer:
        candidates = tuple(c for c in candidates if c != "flat") or ("hierarchical",)
    return candidates


def auto_group_kinds(topology: Topology, shards_optimizer: bool = False) -> tuple[str, ...]:
    """The CommGroups kinds ``auto`` talks over on ``topology``: its candidates' together, and the world where
    it calibrates (:func:`measure_levels` times every level, flat's too, whatever it may choose)."""
    candidates = auto_candidates(topology, shards_optimizer)
    kinds: list[str] = ["world"] if len(candidates) > 1 else []
    for name in candidates:
        kinds += [k for k in ALGORITHM_CLASSES[name].group_kinds if k not in kinds]
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


def _timed(run: Callable[[], Any], device: torch.device, repeats: int,
           before: Callable[[], Any] | None = None) -> float:
    """Median seconds of ``run()`` (it issues collectives and returns their Works) over ``repeats``, after
    one warm-up; each time waits for every Work and, on CUDA, for the device (NCCL's wait only orders
    streams). ``before`` runs ahead of each try, untimed."""
    times = []
    for _ in range(repeats + 1):
        if before is not None:
            before()
        start = time.perf_counter()
        for work in run():
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _points(times: list[float], sizes: tuple[float, ...], p: int) -> list[tuple[float, float, float]]:
    """(steps, bytes, seconds) per size of a ring all-reduce over p ranks, which are also those of a rooted
    pair (reduce then broadcast, reduce-scatter then all-gather): 2(p-1) steps moving 2(p-1)/p of the bytes."""
    return [(2 * (p - 1), 2 * (p - 1) / p * s, t) for s, t in zip(sizes, times)]


def measure_levels(groups: CommGroups, device: torch.device | str = "cpu",
                   sizes: tuple[int, ...] = CALIBRATION_SIZES, repeats: int = CALIBRATION_REPEATS) -> Model:
    """Fit alpha and beta of every candidate's phases from its own collectives, timed at ``sizes``.

    Collective over every rank (it talks over ``groups.world``, ``intra`` and
    ``leaders``, and ``cross`` where built); every rank returns the same
    model. Timed as the algorithms run them:

    - hierarchical: a reduce to the leader then a broadcast back inside the
      node (``intra``: 2(g-1) steps moving 2(g-1)/g of the bytes), and an
      all-reduce among the n leaders (``inter``: 2(n-1) steps, 2(n-1)/n of
      the bytes);
    - flat: an all-reduce over all ranks (``flat``: a ring of 2(N-1) steps, N = n x g with nodes of the
      largest size, as the model prices it);
    - sharded (equal nodes): the node's all-to-all with the sum of the
      received shards, then one broadcast per shard (``sharded_intra``, as
      intra), and every local rank's shard all-reduced across nodes at once
      after a barrier, so the g all-reduces share the node's links as they
      do in training (``sharded_inter``: 2(n-1) steps, 2(n-1)/n of S/g).

    These are the formulas :mod:`hybrid.core.costmodel` predicts with, so each
    candidate is priced from what its collectives cost on this job's links,
    not derived from another algorithm's. ``nics_per_node`` (the leaders'
    all-reduce over the g concurrent ones at the largest size, in whole
    NICs) is reported; the measured ``sharded_inter`` is what prices sharded.
    """
    topo = groups.topology
    if groups.world is None or groups.intra is None or (groups.leaders is None and topo.is_leader):
        raise ValueError("measure_levels needs the world, intra and leaders groups")
    if len(sizes) < 2:
        raise ValueError(f"calibration needs at least two sizes, got {sizes}")
    device = torch.device(device)
    buf = torch.zeros(max(sizes) // 4, dtype=torch.float32, device=device)
    sharded = groups.cross is not None and topo.nnodes > 1 and topo.local_world_size > 1  # alike on every rank
    # Sharded's intra-node phases are timed through its own methods (no collective happens at construction).
    sharded_comm = ShardedCommunicator(groups) if sharded else None
    inbox = buf.new_empty(buf.numel() + topo.local_world_size) if sharded else buf
    phases = ("intra", "inter", "flat", "s_intra", "s_inter") if sharded else ("intra", "inter", "flat")
    timings: dict[str, list[float]] = {k: [0.0] * len(sizes) for k in phases}
    for i, size in enumerate(sizes):
        for phase, seconds in _time_phases(groups, buf[: size // 4], inbox, sharded_comm, device, repeats).items():
            timings[phase][i] = seconds
    # The slowest rank's time per size and phase, on every rank: one model everywhere.
    times = torch.tensor([t for k in phases for t in timings[k]], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=groups.world)
    flat_times = times.cpu().tolist()
    slowest = {k: flat_times[j * len(sizes):(j + 1) * len(sizes)] for j, k in enumerate(phases)}
    return fit_calibration(slowest, sizes, Layout.uniform(topo.nnodes, max(topo.node_sizes)))


def _time_phases(groups: CommGroups, piece: torch.Tensor, inbox: torch.Tensor,
                 sharded_comm: ShardedCommunicator | None, device: torch.device, repeats: int) -> dict[str, float]:
    """This rank's median seconds of every phase :func:`measure_levels` fits, on ``piece`` (phases this rank
    takes no part in are left out). Every rank times them in this order."""
    topo = groups.topology
    local, nnodes = topo.local_world_size, topo.nnodes
    shards = torch.tensor_split(piece, local)
    barrier = lambda: dist.barrier(group=groups.world)  # noqa: E731 - so that concurrent phases start together
    seconds: dict[str, float] = {}
    if local > 1:

        def reduce_then_broadcast() -> list[Any]:
            dist.reduce(piece, dst=topo.leader, group=groups.intra, async_op=True).wait()
            return [dist.broadcast(piece, src=topo.leader, group=groups.intra, async_op=True)]

        seconds["intra"] = _timed(reduce_then_broadcast, device, repeats)
    if topo.is_leader and nnodes > 1:
        seconds["inter"] = _timed(lambda: [dist.all_reduce(piece, group=groups.leaders, async_op=True)],
                                  device, repeats)
    seconds["flat"] = _timed(lambda: [dist.all_reduce(piece, group=groups.world, async_op=True)],
                             device, repeats, before=barrier)
    if sharded_comm is not None:

        def reduce_scatter_then_gather() -> list[Any]:
            sharded_comm.start_scatter(piece, shards, inbox).wait()
            sharded_comm.add_up(shards, inbox)
            return sharded_comm.start_gather(shards)

        seconds["s_intra"] = _timed(reduce_scatter_then_gather, device, repeats)
        seconds["s_inter"] = _timed(lambda: [dist.all_reduce(shards[topo.local_rank], group=groups.cross,
                                                             async_op=True)], device, repeats, before=barrier)
    return seconds


def fit_calibration(seconds: dict[str, list[float]], sizes: tuple[int, ...], layout: Layout) -> Model:
    """The model :func:`measure_levels` fits from the slowest rank's ``seconds`` per phase and size.

    ``layout`` is the uniform layout the model prices (nodes of the largest
    size: the slowest node paces every phase), so each level is fitted with
    the same rank counts :func:`hybrid.core.costmodel.predict` uses, and the model
    reproduces the timed points: flat over n x g ranks, the intra levels over
    g, the inter levels over n (sharded's with S/g bytes per cross group).
    Keys: intra, inter, flat, and s_intra, s_inter where sharded was timed.
    """
    n, g = layout.nnodes, layout.node_sizes[0]
    intra = fit_level(_points(seconds["intra"], sizes, g))
    inter = fit_level(_points(seconds["inter"], sizes, n))
    flat = fit_level(_points(seconds["flat"], sizes, n * g))
    if "s_inter" not in seconds:
        return Model(intra, inter, 1, flat)
    largest = sizes.index(max(sizes))
    spread_s, leaders_s = seconds["s_inter"][largest], seconds["inter"][largest]
    # How many links sharded's g all-reduces spread over, in whole NICs (at least 1, at most g): reported;
    # the measured s_inter level is what prices sharded.
    nics = min(g, max(1, round(leaders_s / spread_s))) if spread_s > 0 else 1
    return Model(intra, inter, nics, flat, fit_level(_points(seconds["s_intra"], sizes, g)),
                 fit_level(_points(seconds["s_inter"], tuple(s / g for s in sizes), n)))


class AutoCommunicator(Communicator):
    """Averages each tensor with the algorithm the calibrated cost model predicts fastest for its size.

    Build it on every rank at once (the calibration is collective), over
    groups of :func:`auto_group_kinds`. ``model`` skips the calibration (e.g.
    one fitted from ``hybrid.tools.bench`` runs; it must be the same on every rank). ``shards_optimizer``:
    it serves a node-sharded optimizer, so it chooses only among algorithms that can gather the updated
    parameters inside the node (:func:`auto_candidates`), and leaves sharded's gradient all-gather out.
    """

    name = AUTO
    group_kinds = ()  # depends on the topology: auto_group_kinds()
    compresses_inter = True  # passed to its choices of hierarchical and sharded

    def __init__(self, groups: CommGroups, counters: PhaseCounters | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none",
                 model: Model | None = None, device: torch.device | str = "cpu", shards_optimizer: bool = False,
                 ) -> None:
        super().__init__(groups, counters, chunk_bytes)
        topo = groups.topology
        self.shards_optimizer = shards_optimizer
        self.candidates = auto_candidates(topo, shards_optimizer)
        kinds = auto_group_kinds(topo, shards_optimizer)
        missing = [k for k in kinds if k not in groups.kinds]
        if missing:
            raise ValueError(f"auto talks over the groups {list(kinds)}, but {missing} were not "
                             f"built: pass kinds=auto_group_kinds(topology) to CommGroups.build")
        self.group_kinds = kinds  # this topology's (a node-sharded optimizer looks for "intra" in them)
        self.inter_compression = inter_compression
        # Every member counts into this communicator's counters, under its own phase names.
        self.members: dict[str, Communicator] = {
            name: ALGORITHM_CLASSES[name](groups, self.counters, chunk_bytes,
                                 "none" if name == "flat" else inter_compression)
            for name in self.candidates
        }
        self.calibration_s = self.probe_s = 0.0
        # The node leaders' pairwise rates (each leader holds them; None elsewhere): a node with a slow NIC.
        self.links: LinkReport | None = None
        if len(self.candidates) > 1 and model is None:
            start = time.perf_counter()
            model = measure_levels(groups, device)
            self.calibration_s = time.perf_counter() - start
            if topo.nnodes > 1 and groups.leaders is not None:
                start = time.perf_counter()
                self.links = probe_links(topo, groups.leaders)
                self.probe_s = time.perf_counter() - start
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
            decision = Decision(nbytes, str(dtype).replace("torch.", ""), self.candidates[0], {})
        else:
            predicted = {name: self._predict(name, nbytes, dtype) for name in self.candidates}
            chosen = min(self.candidates, key=predicted.__getitem__)  # first of equals: the simpler one
            decision = Decision(nbytes, str(dtype).replace("torch.", ""), chosen, predicted)
        with self._lock:
            return self.decisions.setdefault(key, decision)

    def _predict(self, name: str, nbytes: int, dtype: torch.dtype) -> float:
        assert self.model is not None
        model = self.model
        compressor = self.members[name].compressor
        if compressor.applies_to(torch.empty(0, dtype=dtype)):
            # The inter-node phase carries the wire dtype's bytes per value instead of dtype's.
            wire = compressor.wire_dtype.itemsize / dtype.itemsize
            sharded_inter = model.sharded_inter and model.sharded_inter.per_byte_scaled(wire)
            model = replace(model, inter=model.inter.per_byte_scaled(wire), sharded_inter=sharded_inter)
        return predict(model, name, self.layout, nbytes, chunk_bytes=self.chunk_bytes)["total"]

    def compressors(self) -> dict[str, InterCompressor]:
        return {name: c for member in self.members.values() for name, c in member.compressors().items()}

    def member_for(self, tensor: torch.Tensor) -> Communicator:
        return self.members[self.decide(tensor.nbytes, tensor.dtype).chosen]

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable, gather: bool = True) -> None:
        self.member_for(flat)._sum_(flat, divisor, key, gather)  # each member takes gather (flat sums it all)

    def starter_for(self, tensor: torch.Tensor) -> Callable[..., "torch.futures.Future[torch.Tensor]"] | None:
        return self.member_for(tensor).starter_for(tensor)

    def report(self) -> dict[str, Any]:
        """The calibration and every decision so far, JSON-ready (metrics.json's ``comm_auto``)."""
        model = None if self.model is None else {
            level: {"alpha_s": lv.alpha_s, "beta_s_per_byte": lv.beta_s_per_byte, "gbit_per_s": lv.gbit_per_s}
            for level in MODEL_LEVELS if (lv := getattr(self.model, level)) is not None
        }
        with self._lock:
            decisions = sorted(self.decisions.values(), key=lambda d: d.nbytes)
        return {"candidates": list(self.candidates), "calibration_s": self.calibration_s, "model": model,
                "nics_per_node": None if self.model is None else self.model.nics_per_node,
                "link_probe": None if self.links is None else {**self.links.as_dict(), "seconds": self.probe_s},
                "decisions": [d.as_dict() for d in decisions]}
