"""Which slice of every parameter a worker's optimizer shard holds: the layout a node-sharded optimizer steps.

DDP averages gradients bucket by bucket; hybrid's communicators cut each bucket
into pipeline pieces and each piece into one part per worker of the node
(:meth:`hybrid.core.comm.base.Communicator.shard_ranges`). Under
``comm=sharded`` that part is exactly what the worker holds, averaged over every
node, after the cross-node phase. A worker's optimizer shard is those parts:
the slices of the parameters that lie under them (:class:`Segment`), cut
wherever a part's boundary falls, inside a parameter or not. That is why the
optimizer must be elementwise (:data:`ELEMENTWISE`): Adam's update of an element
reads only that element's gradient and state, so stepping slices gives the
same numbers as stepping whole tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid.core.comm.base import Communicator
from hybrid.core.topology import Topology
from hybrid.core.untouched import untouched_tensor

__all__ = ["ELEMENTWISE", "BucketShards", "GatheredState", "NoState", "Segment", "ShardLayout", "check_elementwise",
           "collective", "first_rank", "segments_of", "slice_of"]

# torch.optim classes whose update of an element reads only that element's gradient and state (and scalars
# such as the step count), so that a slice of a tensor steps as it would inside the whole tensor.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "Rprop", "ASGD")
_WHOLE_TENSOR_WHY = {
    "Adafactor": "its second moment is factored into one row and one column statistic per whole matrix",
    "LBFGS": "it takes a closure and searches along a direction of the whole model",
    "SparseAdam": "it takes sparse gradients, which DDP's buckets do not carry",
}


def check_elementwise(cls: type) -> None:
    """Refuse, in one line, an optimizer whose update of an element depends on more than that element."""
    name = getattr(cls, "__name__", repr(cls))
    if getattr(torch.optim, name, None) is cls and name in ELEMENTWISE:
        return
    why = _WHOLE_TENSOR_WHY.get(name, "it is not one of torch.optim's elementwise optimizers, so its update may "
                                      "need whole tensors (a per-tensor norm, as LAMB's trust ratio)")
    raise ValueError(f"optim._target_={getattr(cls, '__module__', '?')}.{name} cannot be sharded by "
                     f"comm.shard_optimizer: {why}; use one of torch.optim.{{{', '.join(ELEMENTWISE)}}}")


@dataclass(frozen=True)
class Segment:
    """A slice of one parameter that this worker's optimizer shard steps."""

    param: int  # the parameter's number in the optimizer (its key in torch's optimizer state_dict)
    start: int  # first element of the slice in the flattened parameter
    numel: int
    bucket: int  # the DDP bucket holding the parameter's gradient
    bucket_start: int  # first element of the slice in the bucket
    position: int  # the parameter's place in its bucket


@dataclass
class BucketShards:
    """One DDP bucket: its parameters in bucket order (their optimizer numbers, -1 where the optimizer does not
    hold one), where each starts in the bucket and how long it is."""

    index: int
    numel: int
    tensors: list[torch.Tensor] = field(repr=False)
    params: list[int]
    offsets: list[int]
    buffer: torch.Tensor = field(repr=False)  # the bucket's storage, as of the last backward

    @classmethod
    def of(cls, bucket: dist.GradBucket, numbers: dict[int, int]) -> "BucketShards":
        """``bucket`` as DDP hands it to the comm hook; ``numbers``: id(parameter) -> its optimizer number."""
        tensors, buffer = list(bucket.parameters()), bucket.buffer()
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + t.numel())
        if offsets.pop() != buffer.numel():
            raise RuntimeError(f"DDP's gradient bucket {bucket.index()} is not its parameters laid end to end")
        return cls(bucket.index(), buffer.numel(), tensors, [numbers.get(id(t), -1) for t in tensors], offsets,
                   buffer)

    @property
    def signature(self) -> tuple[int, ...]:
        return (self.numel, *(id(t) for t in self.tensors))


def segments_of(bucket: BucketShards, ranges: list[tuple[int, int]]) -> list[Segment]:
    """The parameter slices under ``ranges`` (element ranges of ``bucket``, ascending), in bucket order;
    ``param`` is -1 for a slice of a parameter the optimizer does not hold."""
    segments = []
    for position, (param, tensor, p_start) in enumerate(zip(bucket.params, bucket.tensors, bucket.offsets)):
        p_end = p_start + tensor.numel()
        for start, end in ranges:
            lo, hi = max(start, p_start), min(end, p_end)
            if hi > lo:
                segments.append(Segment(param, lo - p_start, hi - lo, bucket.index, lo, position))
    return segments


class ShardLayout:
    """This worker's shard for one bucket layout: every slice under its ranges of each bucket (``owned``), the
    ones the optimizer holds (``segments``) and views of the parameters there (``views``), and the wrapped
    optimizer over those views (``inner``), built with the parameters' groups."""

    def __init__(self, buckets: list[BucketShards], comm: Communicator, params: list[torch.Tensor],
                 group_of: list[int], groups: list[dict[str, Any]], factory: Callable[[Any], torch.optim.Optimizer],
                 ) -> None:
        self.buckets, self.comm = buckets, comm
        self.owned = [segments_of(b, comm.shard_ranges(b.numel, b.buffer.element_size())) for b in buckets]
        self.segments = [s for owned in self.owned for s in owned if s.param >= 0]
        self.views = [params[s.param].detach().view(-1)[s.start:s.start + s.numel] for s in self.segments]
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        for s, view in zip(self.segments, self.views):
            inner_groups[group_of[s.param]]["params"].append(view)
        self.inner = factory(inner_groups)
        self._view_of = dict(zip(self.segments, self.views))

    @property
    def signature(self) -> tuple[tuple[int, ...], ...]:
        return tuple(b.signature for b in self.buckets)

    def grad(self, s: Segment) -> torch.Tensor:
        """The averaged gradient of slice ``s``: its place in the bucket (gradients are bucket views)."""
        return self.buckets[s.bucket].buffer[s.bucket_start:s.bucket_start + s.numel]

    def state_of(self, s: Segment) -> dict[str, Any]:
        return self.inner.state.get(self._view_of[s], {}) if s.param >= 0 else {}

    def state_bytes(self) -> int:
        return sum(v.nbytes for state in self.inner.state.values() for v in state.values() if torch.is_tensor(v))

    def load(self, whole_state: dict[Any, dict[str, Any]], params: list[torch.Tensor], clear: bool = True) -> None:
        """Each slice's part of torch's whole-tensor optimizer state (parameter number -> entries); ``clear``:
        drop what the slices of parameters not in ``whole_state`` hold."""
        if clear:
            self.inner.state.clear()
        for s, view in zip(self.segments, self.views):
            whole = whole_state.get(s.param, whole_state.get(str(s.param)))
            if whole:
                self.inner.state[view] = {k: slice_of(k, v, params[s.param], s) for k, v in whole.items()}

    # The whole state, from every worker's slices.

    def entries(self) -> dict[int, dict[str, Any]]:
        """Per parameter, the node's state entries: scalars (the step count) as they are, elementwise tensors as
        their dtype, to be gathered (:meth:`gather_bucket`). Collective over the node."""
        mine: dict[int, dict[str, Any]] = {}
        for s, view in zip(self.segments, self.views):
            for k, v in self.inner.state.get(view, {}).items():
                elementwise = torch.is_tensor(v) and v.dim() == 1 and v.numel() == s.numel
                mine.setdefault(s.param, {}).setdefault(k, (ELEMENTWISE_STATE, v.dtype) if elementwise else v)
        everyone: list[Any] = [mine]
        if self.comm.topology.local_world_size > 1:
            everyone = [None] * self.comm.topology.local_world_size
            group = self.comm.groups.intra
            collective(self.comm, lambda: dist.all_gather_object(everyone, mine, group=group))
        merged: dict[int, dict[str, Any]] = {}
        for held in everyone:
            for param, entries in held.items():
                for k, v in entries.items():
                    merged.setdefault(param, {}).setdefault(k, v)
        return dict(sorted(merged.items()))

    def pack(self, b: BucketShards, key: str, ranges: list[tuple[int, int]], out: torch.Tensor) -> None:
        """This worker's values of state entry ``key`` under ``ranges`` (some of its ranges of bucket ``b``), laid
        end to end into ``out`` (zeros stay where it holds none)."""
        at, packed = 0, {}
        for start, end in ranges:
            packed[start], at = at, at + end - start
        for s in self.owned[b.index]:
            value = self.state_of(s).get(key)
            start = max((r for r, _ in ranges if r <= s.bucket_start), default=None)
            if torch.is_tensor(value) and start is not None and s.bucket_start < dict(ranges)[start]:
                offset = packed[start] + s.bucket_start - start
                out[offset:offset + s.numel].copy_(value)

    def _skeleton(self) -> tuple[dict[int, dict[str, Any]], list[tuple[str, torch.dtype]]]:
        """The whole state's entries per parameter, scalars filled and elementwise tensors None, and the
        (entry, dtype) kinds of those tensors, in one order on every worker. Collective over the node."""
        entries = self.entries()
        kinds = sorted({(k, v[1]) for e in entries.values() for k, v in e.items() if _is_elementwise(v)},
                       key=lambda kind: (kind[0], str(kind[1])))
        state = {param: {k: (None if _is_elementwise(v) else v) for k, v in e.items()} for param, e in entries.items()}
        return state, kinds

    def gather_bucket(self, b: BucketShards, key: str, dtype: torch.dtype, to_all: bool) -> torch.Tensor | None:
        """State entry ``key`` of every parameter of bucket ``b``, laid whole as the bucket lays gradients: on
        every worker of the node (``to_all``) or on rank 0 (None elsewhere). Each worker sends its ranges'
        values (zeros where it holds none). Collective over the node."""
        topo = self.comm.topology
        ranges = [self.comm.shard_ranges(b.numel, b.buffer.element_size(), j) for j in range(topo.local_world_size)]
        send = torch.zeros(max(sum(e - s for s, e in r) for r in ranges), dtype=dtype)
        self.pack(b, key, ranges[topo.local_rank], send)
        group = self.comm.groups.intra
        if topo.local_world_size == 1:
            received: list[torch.Tensor] | None = [send]
        elif to_all:
            received = [torch.empty_like(send) for _ in ranges]
            collective(self.comm, lambda: dist.all_gather(received, send, group=group))
        else:
            root = first_rank(topo)
            received = [torch.empty_like(send) for _ in ranges] if topo.rank == root else None
            collective(self.comm, lambda: dist.gather(send, received, dst=root, group=group))
        if received is None:
            return None
        whole = torch.empty(b.numel, dtype=dtype)
        for r, values in zip(ranges, received):
            at = 0
            for start, end in r:
                whole[start:end].copy_(values[at:at + end - start])
                at += end - start
        return whole

    def whole_state(self, to_all: bool, on_bucket: Callable[[BucketShards, dict[int, dict[str, Any]]], None]
                    | None = None) -> dict[int, dict[str, Any]]:
        """torch's whole-tensor optimizer state (parameter number -> entries), from the node's slices: on rank 0
        or on every worker of the node (``to_all``). ``on_bucket(b, state)`` is called once bucket ``b``'s
        entries are complete (and may take them out, to hold one bucket at a time). Collective over the node."""
        state, kinds = self._skeleton()
        for b in self.buckets:
            for key, dtype in kinds:
                whole = self.gather_bucket(b, key, dtype, to_all)
                if whole is None:
                    continue
                for param, tensor, offset in zip(b.params, b.tensors, b.offsets):
                    if param >= 0 and key in state.get(param, {}):
                        state[param][key] = whole[offset:offset + tensor.numel()].view(tensor.shape)
            if on_bucket is not None:
                on_bucket(b, state)
        return state


    def deferred_state(self) -> tuple[dict[int, dict[str, Any]], "GatheredState"]:
        """torch's whole-tensor optimizer state with its elementwise tensors left as placeholders (views of one
        untouched mapping per bucket and entry, on rank 0 only: :mod:`hybrid.core.untouched`), and what fills them: the node's gather of each, one
        at a time (:meth:`GatheredState.fill`). What a checkpoint writer streams to disk instead of holding the
        whole state (:mod:`hybrid.app.state.streamed_save`). Collective over the node."""
        state, kinds = self._skeleton()
        jobs = [(b, key, dtype) for b in self.buckets for key, dtype in kinds
                if any(p >= 0 and key in state.get(p, {}) for p in b.params)]
        placeholders: dict[tuple[int, str], torch.Tensor] = {}
        if self.comm.topology.rank == first_rank(self.comm.topology):
            for b, key, dtype in jobs:
                whole = placeholders[(b.index, key)] = untouched_tensor((b.numel,), dtype)
                for param, tensor, offset in zip(b.params, b.tensors, b.offsets):
                    if param >= 0 and key in state.get(param, {}):
                        state[param][key] = whole[offset:offset + tensor.numel()].view(tensor.shape)
        return state, GatheredState(self, jobs, placeholders)


class GatheredState:
    """:meth:`ShardLayout.deferred_state`'s placeholders and their gathers (a
    :class:`hybrid.app.state.streamed_save.Deferred`)."""

    def __init__(self, layout: ShardLayout, jobs: list[tuple[BucketShards, str, torch.dtype]],
                 placeholders: dict[tuple[int, str], torch.Tensor]) -> None:
        self.layout, self.jobs, self._placeholders = layout, jobs, placeholders

    def placeholders(self) -> list[torch.Tensor]:
        return list(self._placeholders.values())

    def fill(self, write: Callable[[torch.Tensor, torch.Tensor, int], None] | None) -> None:
        """Each bucket's entry, one pipeline piece at a time: every worker's part of the piece gathered to rank 0
        and handed to ``write(placeholder, part, first element)`` there, so rank 0 holds one piece at a time.
        Collective over the node."""
        layout = self.layout
        topo, group = layout.comm.topology, layout.comm.groups.intra
        root = first_rank(topo)
        for b, key, dtype in self.jobs:
            for piece in layout.comm.shard_pieces(b.numel, b.buffer.element_size()):
                mine = piece[topo.local_rank]
                send = torch.zeros(max(end - start for start, end in piece), dtype=dtype)
                layout.pack(b, key, [mine], send)
                received = [send]
                if topo.local_world_size > 1:
                    received = [torch.empty_like(send) for _ in piece] if topo.rank == root else []
                    collective(layout.comm, lambda: dist.gather(send, received or None, dst=root, group=group))
                if write is not None and topo.rank == root:
                    for (start, end), values in zip(piece, received):
                        if end > start:
                            write(self._placeholders[(b.index, key)], values[:end - start], start)


class NoState:
    """Nothing deferred (a process outside rank 0's node)."""

    def placeholders(self) -> list[torch.Tensor]:
        return []

    def fill(self, write: Callable[[torch.Tensor, torch.Tensor], None] | None) -> None:
        pass


ELEMENTWISE_STATE = "elementwise"


def _is_elementwise(value: Any) -> bool:
    return isinstance(value, tuple) and value[:1] == (ELEMENTWISE_STATE,)


def first_rank(topology: Topology) -> int:
    """Where a node-sharded optimizer's whole state is gathered: the first rank of its communicator's topology
    (rank 0 of the job; under comm=diloco, whose nodes each hold their own state, the node's leader)."""
    return topology.nodes[0][0]


def collective(comm: Communicator, run: Callable[[], Any]) -> Any:
    """Run ``run``'s collectives in the order of the comm hook's stream (behind its buckets)."""
    stream = comm.groups.stream
    return stream.call(run) if stream is not None and stream.active else run()


def slice_of(key: str, value: Any, param: torch.Tensor, s: Segment) -> Any:
    """A whole parameter's state entry cut to slice ``s``: tensors of the parameter's shape are sliced (and cast
    as torch's own load casts them), scalars (the step count) copied."""
    if not torch.is_tensor(value):
        return value
    if value.shape == param.shape and (value.dim() > 0 or key != "step"):  # a 0-dim parameter's moments too
        part = value.reshape(-1)[s.start:s.start + s.numel]
        dtype = param.dtype if value.is_floating_point() else value.dtype
        return part.to(device=param.device, dtype=dtype).clone()
    return value.clone()
