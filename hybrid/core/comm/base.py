"""The interface every gradient communicator implements, and the averaging rules they share.

A communicator averages a tensor over all ranks, in place. Subclasses only
describe how to *sum* across the mesh (:meth:`Communicator._sum_`); the
precision policy lives here, once, so the three algorithms cannot drift apart:

- fp32 / fp64: sum first, then divide by the world size once (at the cheapest
  point: on the rank that owns the result, before it is broadcast). With
  integer-valued inputs the sum is exact in any order, so every algorithm then
  returns exactly what torch's flat all-reduce followed by a division returns.
- fp16 / bf16: divide by the world size *before* reducing (as DDP's
  fp16_compress_hook does). Every partial sum is then bounded by the largest
  input in magnitude, so no phase can overflow where the inputs are finite,
  even where a plain summing all-reduce of the same tensors would overflow
  to inf. The price is one rounding of x / world per element.

With ``inter_compression`` (bf16/fp16), fp32/fp64 values are divided before
the inter-node all-reduce instead, on the ranks that send them across nodes
(see :mod:`hybrid.core.comm.compression`).
"""

from __future__ import annotations

import functools
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist

from hybrid.core.comm.compression import InterCompressor
from hybrid.core.comm.counters import PhaseCounters, allreduce_bytes, rooted_bytes
from hybrid.core.comm.groups import CommGroups
from hybrid.core.timeline import profiler_range
from hybrid.core.topology import Topology

__all__ = ["DEFAULT_CHUNK_BYTES", "PIPELINE_WINDOW", "CommError", "Communicator", "LOW_PRECISION", "SUPPORTED_DTYPES",
           "comm_error"]

# Two-level algorithms cut large tensors into pieces of this size and pipeline
# them: piece k crosses the network while piece k+1 is still being reduced
# inside the node and piece k-1 is being broadcast back.
DEFAULT_CHUNK_BYTES = 4 * 2**20
# At most this many pieces are between issue and completion in each phase:
# enough to keep the slow link busy while the next piece is reduced, and it
# bounds the transport's scratch buffers (gloo allocates one per in-flight
# reduce / all-reduce) to a few pieces instead of the whole bucket.
PIPELINE_WINDOW = 2

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass
class _Inter:
    """An inter-node all-reduce in flight: its Work, the tensor on the wire, whether it was pre-divided, and
    where the compression guard checks this one, the same values' full-precision all-reduce (Work, tensor)."""

    work: Any
    wire: torch.Tensor
    divided: bool
    full: tuple[Any, torch.Tensor] | None = None


@functools.cache
def _takes_gather(cls: type) -> bool:
    """Whether ``cls._sum_`` takes ``gather`` (a subclass written before it existed may not)."""
    return "gather" in inspect.signature(cls._sum_).parameters


class CommError(RuntimeError):
    """A collective of one phase failed (peer gone, timeout); the message says where."""


def comm_error(what: str, topo: Topology, exc: BaseException, start: float) -> CommError:
    """The error a failed collective (``what``, begun at ``start``) raises, in one line: what, rank, node,
    how long it waited, and the transport's first line (a peer gone, a timeout)."""
    cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CommError(f"{what} failed on rank {topo.rank} (node {topo.node}, local rank {topo.local_rank}) after "
                     f"{time.perf_counter() - start:.1f}s: {cause}")


class Communicator(ABC):
    """Averages tensors across all ranks of ``groups.topology``.

    Collective: every rank calls :meth:`all_reduce_mean_` with tensors of the
    same shape and dtype, in the same order.
    """

    name: ClassVar[str]
    # The CommGroups kinds this algorithm talks over (what CommGroups.build must have built).
    group_kinds: ClassVar[tuple[str, ...]]
    # Whether it has an inter-node phase of its own that ``inter_compression`` can narrow.
    compresses_inter: ClassVar[bool] = False

    def __init__(self, groups: CommGroups, counters: PhaseCounters | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, inter_compression: str = "none") -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
        missing = [k for k in self.group_kinds if k not in groups.kinds]
        if missing:
            raise ValueError(f"{self.name} talks over the groups {list(self.group_kinds)}, but "
                             f"{missing} were not built: pass kinds={list(self.group_kinds)} to CommGroups.build")
        self.groups = groups
        self.topology = groups.topology
        self.counters = counters if counters is not None else PhaseCounters()
        self.chunk_bytes = chunk_bytes
        self.compressor = InterCompressor(inter_compression)
        self.hooks_registered = 0  # DDP models hooked to this communicator so far (hybrid.core.comm.ddp_hook)

    def compressors(self) -> dict[str, InterCompressor]:
        """The inter-node compressors whose error-feedback residuals this rank keeps, by algorithm name
        (empty without ``inter_compression``): what a checkpoint must carry for an exact resume."""
        return {self.name: self.compressor} if self.compressor.wire_dtype is not None else {}

    def _chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Pipeline pieces of ``flat`` (views), each at most ``chunk_bytes`` long."""
        per_chunk = max(1, self.chunk_bytes // flat.element_size())
        return list(torch.split(flat, per_chunk))

    def _wait(self, phase: str, works: list, nbytes: int) -> None:
        """Block until ``works`` finish; the wait counts as time spent in ``phase``."""
        with self._phase(phase, nbytes):
            for work in works:
                work.wait()

    def all_reduce_mean_(self, tensor: torch.Tensor, key: Hashable = None) -> torch.Tensor:
        """Replace ``tensor`` by its mean over all ranks and return it.

        ``key`` names a tensor that recurs every step (the DDP hook passes the
        bucket index and size): with ``inter_compression``, its error-feedback
        residual is kept under that name; without a key, tensors of one size
        share one.
        """
        return self._mean_(tensor, key, gather=True)

    def reduce_scatter_mean_(self, tensor: torch.Tensor, key: Hashable = None) -> torch.Tensor:
        """Average ``tensor`` over all ranks at least where this rank owns it (:meth:`shard_ranges`); the rest
        of ``tensor`` is left undefined. What a node-sharded optimizer needs: each worker steps only its
        shard, then the node gathers the updated parameters (:meth:`all_gather_shards_`). An algorithm whose
        last phase is the node's all-gather (sharded) skips it here; the others average all of it."""
        return self._mean_(tensor, key, gather=False)

    def _mean_(self, tensor: torch.Tensor, key: Hashable, gather: bool) -> torch.Tensor:
        self._check_dtype(tensor)
        world = self.topology.world_size
        if tensor.numel() == 0 or world == 1:
            return tensor
        stream = self.groups.stream
        if stream is not None and stream.active and not stream.on_own_thread():
            # A DDP hook's thread is issuing collectives on these groups: queue behind what it has, so
            # this call's collectives leave every rank in the same place of one order.
            return stream.call(lambda: self._mean_(tensor, key, gather))
        # Collectives need one contiguous buffer; DDP buckets already are one.
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
        divisor, name = self._prescale_(flat), ("size", flat.numel()) if key is None else key
        if gather or not _takes_gather(type(self)):
            self._sum_(flat, divisor, name)  # (an algorithm of older days sums all of it: that holds the shard too)
        else:
            self._sum_(flat, divisor, name, gather=False)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def shard_pieces(self, numel: int, element_size: int) -> list[list[tuple[int, int]]]:
        """How a flat tensor of ``numel`` elements is shared by the node's workers: per pipeline piece
        (:meth:`_chunks`), the element range ``[start, end)`` each local rank owns, by ``torch.tensor_split``'s
        rule (the first ``len % g`` parts are one longer; a part may be empty). The same on every node, so a
        shard lines up across nodes."""
        local = self.topology.local_world_size
        per_chunk = max(1, self.chunk_bytes // element_size)
        pieces = []
        for start in range(0, numel, per_chunk):
            base, extra = divmod(min(per_chunk, numel - start), local)
            bounds = [start]
            for j in range(local):
                bounds.append(bounds[-1] + base + (1 if j < extra else 0))
            pieces.append(list(zip(bounds[:-1], bounds[1:])))
        return pieces

    def shard_ranges(self, numel: int, element_size: int, local_rank: int | None = None) -> list[tuple[int, int]]:
        """The non-empty element ranges of a flat tensor of ``numel`` elements that local rank ``local_rank``
        (default: this rank's) owns, one per pipeline piece (:meth:`shard_pieces`)."""
        j = self.topology.local_rank if local_rank is None else local_rank
        return [piece[j] for piece in self.shard_pieces(numel, element_size) if piece[j][1] > piece[j][0]]

    def all_gather_shards_(self, flat: torch.Tensor) -> torch.Tensor:
        """Inside the node, every rank's :meth:`shard_ranges` of ``flat`` (1-D, contiguous) broadcast from the
        rank that owns them, so every worker of the node ends with the owners' values everywhere. Counted as
        ``intra_broadcast``. Collective over the node's workers."""
        topo = self.topology
        local = topo.local_world_size
        if local == 1 or flat.numel() == 0:
            return flat
        stream = self.groups.stream
        if stream is not None and stream.active and not stream.on_own_thread():
            return stream.call(lambda: self.all_gather_shards_(flat))
        if self.groups.intra is None:
            raise ValueError(f"{self.name} has no intra-node group to gather shards over")
        works = [dist.broadcast(flat[start:end], src=topo.node_ranks[j], group=self.groups.intra, async_op=True)
                 for piece in self.shard_pieces(flat.numel(), flat.element_size())
                 for j, (start, end) in enumerate(piece) if end > start]
        self._wait("intra_broadcast", works, rooted_bytes(flat.nbytes, local))
        return flat

    def starter_for(self, tensor: torch.Tensor) -> Callable[..., "torch.futures.Future[torch.Tensor]"] | None:
        """A ``start_mean_(tensor, on_done=None) -> Future`` that averages ``tensor`` without a thread of
        ours (issued straight from DDP's backward), or None where the algorithm needs dependent phases
        (the DDP hook then runs :meth:`all_reduce_mean_` on the groups' ordered stream)."""
        return None

    @abstractmethod
    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable, gather: bool = True) -> None:
        """Sum ``flat`` (1-D, contiguous, non-empty) over all ranks in place.

        ``gather=False``: only this rank's :meth:`shard_ranges` need the result (an algorithm may then skip
        what only carries the other shards).

        If ``divisor`` is given, the result must also be divided by it, on the
        rank(s) that own it before it is sent back out, so each element is
        divided exactly once and every rank receives identical bits. ``key``
        names ``flat`` for the inter-node compression's residuals.
        """

    def _pipeline(self, n: int, *, reduce: Callable[[int], list], reduced: Callable[[int], None],
                  cross: Callable[[int], None], finish: Callable[[int], list],
                  reduce_bytes: Callable[[int], int], broadcast_bytes: int) -> None:
        """The two-level algorithms' one schedule over ``n`` pipeline pieces.

        ``reduce(i)`` starts piece i's intra-node reduce and returns its
        Works ([] where there is nothing to reduce), ``reduced(i)`` runs once
        they are done, ``cross(i)`` starts its inter-node all-reduce and
        ``finish(i)`` waits for that, divides and returns the intra-node
        broadcasts it started. At most ``PIPELINE_WINDOW`` pieces run ahead in
        each phase. Every rank follows this order, which depends only on
        ``n``, so each group sees its collectives in the same order
        everywhere: intra: reduces 0..W-1, then per piece i "reduce i+W,
        broadcast i-W", then the last broadcasts; inter: pieces in order.
        """
        window = PIPELINE_WINDOW
        reduces: dict[int, list] = {}
        broadcasts: list = []

        def start(i: int) -> None:
            if i < n and (works := reduce(i)):
                reduces[i] = works

        for i in range(window):
            start(i)
        for i in range(n):
            if i in reduces:
                self._wait("intra_reduce", reduces.pop(i), reduce_bytes(i))
                reduced(i)
            start(i + window)  # into the scratch space piece i has just emptied
            cross(i)
            if i >= window:
                broadcasts += finish(i - window)
        for i in range(max(0, n - window), n):
            broadcasts += finish(i)
        if broadcasts:
            self._wait("intra_broadcast", broadcasts, broadcast_bytes)

    def _start_inter(self, tensor: torch.Tensor, group: Any, divisor: int | None, key: Hashable) -> _Inter:
        """Start the inter-node all-reduce of ``tensor`` over ``group``, compressed where configured.

        Compressed, ``tensor`` is divided first (the sum of 16-bit values then
        stays in fp16's range, as in torch's fp16 compression hook) and the
        16-bit copy travels; :meth:`_finish_inter` writes the result back.
        """
        if self.compressor.applies_to(tensor):
            if divisor is not None:
                self._divide_(tensor, divisor)
            full = tensor.clone() if self.compressor.due(key) else None  # the guard's full-precision twin
            wire = self.compressor.compress_(tensor, key)
            inter = _Inter(dist.all_reduce(wire, group=group, async_op=True), wire, divided=True)
            if full is not None:
                inter.full = (dist.all_reduce(full, group=group, async_op=True), full)
            return inter
        return _Inter(dist.all_reduce(tensor, group=group, async_op=True), tensor, divided=False)

    def _finish_inter(self, tensor: torch.Tensor, inter: _Inter, nnodes: int) -> bool:
        """Wait for :meth:`_start_inter`'s all-reduce; return whether ``tensor`` is already divided."""
        works = [inter.work] + ([inter.full[0]] if inter.full is not None else [])
        nbytes = allreduce_bytes(inter.wire.nbytes + (inter.full[1].nbytes if inter.full is not None else 0), nnodes)
        self._wait("inter_allreduce", works, nbytes)
        if inter.wire is not tensor:
            tensor.copy_(inter.wire)
        if inter.full is not None:
            self.compressor.judge(tensor, inter.full[1])
        return inter.divided

    @contextmanager
    def _phase(self, name: str, nbytes: int) -> Iterator[None]:
        """Time the enclosed collectives as phase ``name``; name the phase and rank on failure.

        The block must wait for its collectives, so the time is what this rank
        spent in the phase.
        """
        with profiler_range(name):
            start = time.perf_counter()
            try:
                yield
            except Exception as exc:
                raise self._comm_error(name, exc, start) from exc
            self.counters.add(name, time.perf_counter() - start, nbytes, start)

    def _comm_error(self, phase: str, exc: BaseException, start: float) -> CommError:
        """The error a failed collective of ``phase`` (begun at ``start``) raises: algorithm, phase, rank, node."""
        return self._failure_describer()(phase, exc, start)

    def _failure_describer(self) -> Callable[[str, BaseException, float], CommError]:
        """:meth:`_comm_error` as a function that holds only the name and topology, not the communicator."""
        name, topo = self.name, self.topology

        def describe(phase: str, exc: BaseException, start: float) -> CommError:
            return comm_error(f"{name} {phase}", topo, exc, start)

        return describe

    def _prescale_(self, flat: torch.Tensor) -> int | None:
        """Apply the precision policy before the sum; return the divisor left for after it.

        fp16/bf16 are divided by the world size here (None is left), fp32/fp64
        keep the division for after the sum (the world size is returned).
        """
        world = self.topology.world_size
        if flat.dtype in LOW_PRECISION:
            self._divide_(flat, world)
            return None
        return world

    @staticmethod
    def _divide_(tensor: torch.Tensor, divisor: int) -> torch.Tensor:
        """``tensor.div_(divisor)``, with the same bits but cheaper where ``divisor`` is a power of two.

        x * 2**-k is the same real number as x / 2**k, so both round to the
        same float (subnormals included); a multiply streams faster than a
        divide, which matters because this pass is the only work flat adds to
        a bare all-reduce.
        """
        if divisor & (divisor - 1) == 0:
            return tensor.mul_(1.0 / divisor)
        return tensor.div_(divisor)

    @staticmethod
    def _check_dtype(tensor: torch.Tensor) -> None:
        if tensor.dtype not in SUPPORTED_DTYPES:
            allowed = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise TypeError(f"dtype {tensor.dtype} is not supported: use one of {allowed}")
