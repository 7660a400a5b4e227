"""Alpha-beta cost model of the three all-reduce algorithms on a two-level cluster.

Each level has a latency ``alpha`` (seconds per message step) and an inverse
bandwidth ``beta`` (seconds per byte): intra-node (NVLink, or a namespace's
local path on the testbed) and inter-node (each node's NIC). For S bytes over
n nodes of g workers (N = n g ranks):

- ``flat``: a ring over all N ranks laid out node by node. Each of its
  2(N-1) steps moves S/N bytes over every hop at once; n of the hops cross a
  NIC, so each NIC carries 2(N-1)/N x S bytes and every step waits for the
  slowest (inter-node) hop: 2(N-1) (alpha_e + S/N beta_e'), where beta_e'
  is the NIC level seen by the ring's ``flat_channels`` connections: NCCL
  stripes its channels over every NIC of the node (gloo's ring: one). On two
  nodes NCCL runs a tree instead (``two_node_tree``): S crosses each NIC once
  each way, 2 alpha_e + S beta_e'.
- ``hierarchical``: reduce to the leader and broadcast back, each
  (g-1) alpha_i + (g-1)/g S beta_i; between them a ring of the n leaders,
  2(n-1) alpha_e + 2(n-1)/n S beta_e', the leader's one connection through
  one NIC (``leader_nics`` to spread it).
- ``sharded``: reduce-scatter and all-gather inside the node (same cost as
  reduce and broadcast above) around g concurrent all-reduces of S/g bytes
  across nodes, g connections over min(g, k) of the node's k NICs:
  2(n-1) alpha_e + 2(n-1)/n S beta_e'.

beta_e' for c concurrent connections over up to k NICs (:meth:`Model.spread`)
is max(beta_e / min(c, k), beta_c / c): the NICs in use, unless each
connection is capped below its share (``conn_gbps``; one TCP stream does not
fill a fast NIC, which is why g parallel groups can beat one ring).

On one level (n = 1 or g = 1) the formulas fall back to a single ring on the
level that is present.

These derivations price all three algorithms from two measured levels. Where
an algorithm's own collectives were timed (``comm=auto`` does, at start-up),
:class:`Model` carries their levels too (``flat``, ``sharded_intra``,
``sharded_inter``) and they price that algorithm instead: a library's
all-to-all, or g all-reduces sharing a link, need not cost what a rooted
reduce or a single all-reduce suggests.

The two-level algorithms pipeline a large tensor in pieces of ``chunk_bytes``
(the communicator's ``pipeline_chunk_mb``): pass it to :func:`predict` and the
total becomes one piece through every phase plus (k - 1) pieces at the pace
of the busier level, the usual pipeline bound (the reduce and the broadcast
share the intra-node level, so they count together against the inter-node
all-reduce); without it the phases add up. :func:`calibrate` fits alpha and beta per level from
``hybrid.bench`` JSON (relative least squares: the NIC from flat's single collective, the intra level
from the phases of unpipelined rows), so predictions for clusters nobody here has use figures measured on
the testbed; ``python -m hybrid.costmodel --calibrate A.json --check B.json ...`` compares the model
with other bench runs (other layouts, other NIC counts), row by row.

``python -m hybrid.costmodel --layout 1024x8 --sizes 25M,1G`` prints predictions (:mod:`hybrid.tools.costmodel`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterable

from hybrid.core.topology import Layout

__all__ = ["MODELLED_ALGORITHMS", "PHASES", "Level", "Model", "bench_chunk_bytes", "calibrate", "fit_level", "fit_overlap",
           "predict", "predict_all"]

MODELLED_ALGORITHMS = ("flat", "hierarchical", "sharded")
# The phases every algorithm reports (hybrid.core.comm.counters says what each is) and this model prices. Named
# here, where nothing imports torch, so that the report can name them without importing torch.
PHASES = ("flat_allreduce", "intra_reduce", "inter_allreduce", "intra_broadcast")


@dataclass(frozen=True)
class Level:
    alpha_s: float  # seconds per message step
    beta_s_per_byte: float  # seconds per byte (1 / bandwidth)

    def step(self, nbytes: float) -> float:
        return self.alpha_s + nbytes * self.beta_s_per_byte

    @classmethod
    def from_bandwidth(cls, alpha_us: float, gbit_per_s: float) -> "Level":
        return cls(alpha_us * 1e-6, 8.0 / (gbit_per_s * 1e9))

    def per_byte_scaled(self, factor: float) -> "Level":
        """This level with ``factor`` times the seconds per byte: a wire carrying fewer bytes per value
        (factor < 1), or the bytes spread over several links at once."""
        return Level(self.alpha_s, self.beta_s_per_byte * factor)

    @property
    def gbit_per_s(self) -> float | None:
        """The bandwidth ``beta`` stands for (None where the fit resolved none: beta 0)."""
        return 8e-9 / self.beta_s_per_byte if self.beta_s_per_byte > 0 else None


@dataclass(frozen=True)
class Model:
    """Per-level costs, and optionally levels fitted from an algorithm's own collectives.

    ``intra`` and ``inter`` price every algorithm by default (the formulas in
    the module docstring). Where ``flat``, ``sharded_intra`` or
    ``sharded_inter`` are given (``comm=auto`` times them at start-up), they
    price that algorithm's phase instead of the derivation: what the library
    really does for an all-to-all, or for g all-reduces sharing the node's
    links, need not be what a rooted reduce or one all-reduce suggests.
    ``flat`` is per step of a ring over every rank; ``sharded_inter`` per
    step of one cross group's all-reduce while all g run at once (it then
    replaces ``nics_per_node``).
    """

    intra: Level
    inter: Level  # one NIC
    nics_per_node: int = 1
    flat: Level | None = None
    sharded_intra: Level | None = None
    sharded_inter: Level | None = None
    # What one connection (a TCP stream, an IB queue pair) can carry at most, Gbit/s; None: a connection fills
    # its NIC. One TCP stream does not fill a fast NIC, so g parallel groups (sharded) can beat one ring.
    conn_gbps: float | None = None
    # Connections flat's ring runs side by side across each node boundary (NCCL's channels, striped over the
    # node's NICs); gloo's ring: 1.
    flat_channels: int = 1
    # NICs hierarchical's leader spreads its all-reduce over (1: one connection through one NIC).
    leader_nics: int = 1
    # Flat on two nodes as NCCL's tree: each NIC carries S across the network, not 2(N-1)/N x S.
    two_node_tree: bool = False
    # How much of the less busy level a pipeline hides behind the busier one: 1 = all (separate engines,
    # NVLink beside the NIC), 0 = none (the phases add up). Both levels share the CPU on the testbed, and
    # copy engines or SMs on a GPU, so a real pipeline hides less than all; calibrate() fits it.
    overlap: float = 1.0

    def __post_init__(self) -> None:
        for key in ("nics_per_node", "flat_channels", "leader_nics"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap={self.overlap} must be in 0..1 (the share of the lesser level a pipeline hides)")
        if self.conn_gbps is not None and not self.conn_gbps > 0:
            raise ValueError(f"conn_gbps={self.conn_gbps} must be > 0 (or None: no per-connection cap)")

    def spread(self, connections: int, nics: int) -> Level:
        """The inter-node level seen by ``connections`` concurrent connections spread over up to ``nics`` of the
        node's NICs: NIC bandwidth times the NICs in use, but no more than the connections' own caps allow."""
        used = max(1, min(connections, nics, self.nics_per_node))
        beta = self.inter.beta_s_per_byte / used
        if self.conn_gbps is not None:
            beta = max(beta, 8.0 / (self.conn_gbps * 1e9) / connections)
        return Level(self.inter.alpha_s, beta)


def _ring_allreduce(level: Level, nbytes: float, p: int) -> float:
    return 2 * (p - 1) * level.step(nbytes / p) if p > 1 else 0.0


def _rooted(level: Level, nbytes: float, p: int) -> float:
    """Reduce (or broadcast, reduce-scatter, all-gather) of nbytes over p ranks."""
    return (p - 1) * level.alpha_s + (p - 1) / p * nbytes * level.beta_s_per_byte if p > 1 else 0.0


def _flat(model: Model, n: int, g: int, nbytes: float) -> float:
    """A ring over all n g ranks (node by node), its channels striped over the NICs; NCCL's tree on 2 nodes."""
    if model.flat is not None:
        return _ring_allreduce(model.flat, nbytes, n * g)
    if n == 1:
        return _ring_allreduce(model.intra, nbytes, g)
    level = model.spread(model.flat_channels, model.flat_channels)
    if n == 2 and model.two_node_tree:
        # Reduce up and broadcast down the tree, pipelined, full duplex: S crosses each NIC once each way.
        return 2 * level.alpha_s + nbytes * level.beta_s_per_byte
    return _ring_allreduce(level, nbytes, n * g)


def predict(model: Model, algorithm: str, layout: Layout, nbytes: float,
            chunk_bytes: float | None = None) -> dict[str, float]:
    """Predicted seconds per phase (same names as the communicator's counters) and ``total``.

    With ``chunk_bytes``, hierarchical and sharded are pipelined in pieces of
    that size: each phase's figure is then its time for all pieces, and
    ``total`` is the pipeline's (see the module docstring).
    """
    if not layout.is_uniform:
        raise ValueError(f"the cost model needs nodes of equal size, got {list(layout.node_sizes)}")
    if chunk_bytes is not None and not chunk_bytes > 0:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be > 0")
    n, g = layout.nnodes, layout.node_sizes[0]
    if algorithm == "flat":
        phases = {"flat_allreduce": _flat(model, n, g, nbytes)}
        phases["total"] = phases["flat_allreduce"]
        return phases
    if algorithm not in ("hierarchical", "sharded"):
        raise ValueError(f"algorithm {algorithm!r} is not one of {', '.join(MODELLED_ALGORITHMS)}")
    pieces = max(1, math.ceil(nbytes / chunk_bytes)) if chunk_bytes else 1
    piece = nbytes / pieces
    if algorithm == "hierarchical":
        leaders = model.spread(model.leader_nics, model.leader_nics)
        intra, inter_s = model.intra, _ring_allreduce(leaders, piece, n)
    else:
        intra = model.sharded_intra or model.intra
        if model.sharded_inter is not None:  # measured: one shard per cross group, all g at once
            inter_s = _ring_allreduce(model.sharded_inter, piece / g, n)
        else:  # g concurrent all-reduces of S/g: g connections over min(g, NICs) NICs
            inter_s = _ring_allreduce(model.spread(g, g), piece, n)
    per_piece = {
        "intra_reduce": _rooted(intra, piece, g),
        "inter_allreduce": inter_s,
        "intra_broadcast": _rooted(intra, piece, g),
    }
    phases = {name: t * pieces for name, t in per_piece.items()}
    phases["total"] = _pipelined(per_piece, pieces, model.overlap)
    return phases


def _pipelined(per_piece: dict[str, float], pieces: int, overlap: float) -> float:
    """One piece through every phase, then each further piece at the busier level's pace plus the part of
    the other level the pipeline does not hide."""
    levels = sorted((per_piece["intra_reduce"] + per_piece["intra_broadcast"], per_piece["inter_allreduce"]))
    return sum(per_piece.values()) + (pieces - 1) * (levels[1] + (1 - overlap) * levels[0])


def predict_all(model: Model, layout: Layout, nbytes: float, chunk_bytes: float | None = None) -> dict[str, float]:
    return {alg: predict(model, alg, layout, nbytes, chunk_bytes)["total"] for alg in MODELLED_ALGORITHMS}


def fit_level(points: list[tuple[float, float, float]], relative: bool = False) -> Level:
    """Least squares t = a * steps + b * bytes over (steps, bytes, seconds) points, a, b >= 0.

    ``relative``: minimise each point's relative error instead of its absolute one, so a 1 MB message
    counts as much as an 80 MB one (what "within 15%" asks of a model).
    """
    if relative:
        points = [(s / t, b / t, 1.0) for s, b, t in points if t > 0]
    s_ss = sum(s * s for s, _, _ in points)
    s_bb = sum(b * b for _, b, _ in points)
    s_sb = sum(s * b for s, b, _ in points)
    s_st = sum(s * t for s, _, t in points)
    s_bt = sum(b * t for _, b, t in points)
    det = s_ss * s_bb - s_sb * s_sb
    if len(points) < 2 or det <= 0:
        raise ValueError("calibration needs at least two message sizes per level")
    alpha = (s_st * s_bb - s_bt * s_sb) / det
    beta = (s_ss * s_bt - s_sb * s_st) / det
    if alpha < 0:  # latency below resolution: fit bandwidth alone
        alpha, beta = 0.0, s_bt / s_bb
    return Level(alpha, max(beta, 0.0))


def bench_chunk_bytes(report: dict[str, Any]) -> float | None:
    """The pipeline piece a ``hybrid.bench`` report ran with (its ``--chunk-mb``), bytes; None: not recorded,
    taken as unpipelined."""
    chunk_mb = report.get("options", {}).get("chunk_mb")
    return None if chunk_mb is None else chunk_mb * 2**20


def _one_piece(report: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether ``row`` fit in one pipeline piece, so its phases ran one after another: pipelined, they
    overlap, and a phase's clock also runs while it waits for the other level."""
    chunk = bench_chunk_bytes(report)
    return chunk is None or row["bytes"] <= chunk


def calibrate(reports: Iterable[dict[str, Any]], nics_per_node: int = 1) -> Model:
    """Fit each level from ``hybrid.bench`` reports (relative least squares: every size counts alike).

    Inter (one NIC): from ``flat`` rows where there are any (one collective: a ring of N ranks through one
    NIC, 2(N-1) steps of S/N bytes); otherwise from ``hierarchical``'s ``inter_allreduce`` (a ring of n
    leaders, 2(n-1) steps of S/n).
    Intra: ``hierarchical``'s ``intra_reduce`` over g ranks, (g-1) steps, (g-1)/g S bytes; ``sharded``'s
    (a reduce-scatter) fits ``sharded_intra`` where there are two sizes of it.
    Phases are taken only from rows of one pipeline piece (:func:`_one_piece`).
    """
    intra: list[tuple[float, float, float]] = []
    sharded_intra: list[tuple[float, float, float]] = []
    inter_flat: list[tuple[float, float, float]] = []
    inter_hier: list[tuple[float, float, float]] = []
    for report in reports:
        layout = Layout(tuple(report["node_sizes"]))
        n, g = layout.nnodes, layout.node_sizes[0]
        for row in report["results"]:
            phases, size, runs_as = row.get("phases_s", {}), row["bytes"], row["runs_as"]
            if runs_as == "flat" and n > 1 and "median_s" in row:
                world = n * g
                inter_flat.append((2 * (world - 1), 2 * (world - 1) / world * size, row["median_s"]))
            if runs_as not in ("hierarchical", "sharded") or not _one_piece(report, row):
                continue
            if g > 1 and "intra_reduce" in phases:
                target = intra if runs_as == "hierarchical" else sharded_intra
                target.append((g - 1, (g - 1) / g * size, phases["intra_reduce"]))
            if runs_as == "hierarchical" and n > 1 and "inter_allreduce" in phases:
                inter_hier.append((2 * (n - 1), 2 * (n - 1) / n * size, phases["inter_allreduce"]))
    inter = fit_level(inter_flat if len({b for _, b, _ in inter_flat}) >= 2 else inter_hier, relative=True)
    shard = fit_level(sharded_intra, relative=True) if len({b for _, b, _ in sharded_intra}) >= 2 else None
    model = Model(fit_level(intra, relative=True), inter, nics_per_node, sharded_intra=shard)
    return replace(model, overlap=fit_overlap(model, reports))


def fit_overlap(model: Model, reports: Iterable[dict[str, Any]]) -> float:
    """The ``overlap`` that best explains the pipelined rows' totals (relative least squares; 1 without any).

    A pipelined total is A + (p - 1)(B + (1 - overlap) C): A one piece through every phase, B the busier
    level's time per piece, C the other's; linear in ``overlap``, so the fit is closed-form."""
    num = den = 0.0
    for report in reports:
        chunk = bench_chunk_bytes(report)
        if chunk is None or report.get("testbed_nics_per_node", 1) != model.nics_per_node:
            continue  # NICs the model does not price as the bench ran them (pieces spread over NICs)
        layout = Layout(tuple(report["node_sizes"]))
        for row in report["results"]:
            if row["runs_as"] not in ("hierarchical", "sharded") or _one_piece(report, row) or layout.nnodes < 2:
                continue
            pieces = math.ceil(row["bytes"] / chunk)
            per_piece = predict(replace(model, overlap=1.0), row["runs_as"], layout, row["bytes"] / pieces)
            hidden_all = predict(replace(model, overlap=1.0), row["runs_as"], layout, row["bytes"], chunk)
            lesser = min(per_piece["intra_reduce"] + per_piece["intra_broadcast"], per_piece["inter_allreduce"])
            u, v = hidden_all["total"] / row["median_s"], (pieces - 1) * lesser / row["median_s"]
            # predicted / measured = u + (1 - overlap) v: minimise the sum of (that - 1)^2 over overlap.
            num, den = num + v * (u + v - 1), den + v * v
    return 1.0 if den == 0 else min(1.0, max(0.0, num / den))
