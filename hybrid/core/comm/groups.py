"""Process groups of the two-level mesh, built once per job.

Every algorithm talks only over these groups, never over the default group:
DDP and the trainer use the default group for their own collectives
(parameter broadcast, unused-parameter maps, metrics), possibly from another
thread, and gloo pairs collectives by their order within a group. Keeping the
communicator's traffic on groups of its own means the two streams of
collectives can never be matched against each other.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from hybrid.core.comm.ordered_stream import OrderedStream
from hybrid.core.topology import Topology

__all__ = ["BACKENDS", "GROUP_KINDS", "CommGroups", "gloo_nics_starting_at", "resolve_backend"]

BACKENDS = ("auto", "gloo", "nccl")
GROUP_KINDS = ("world", "intra", "leaders", "cross")
_STREAM_LOCK = threading.Lock()
GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


@contextmanager
def gloo_nics_starting_at(first: int) -> Iterator[None]:
    """Gloo groups created inside start on the ``first``-th (mod K) of the K NICs in ``GLOO_SOCKET_IFNAME``.

    Gloo opens one device per name in ``GLOO_SOCKET_IFNAME`` and runs a
    group's collectives through them in turn (collective i on device i mod K),
    one at a time. The sharded algorithm's g cross groups run side by side and
    in step, so with the same order everywhere they would all sit on the same
    NIC at once; rotated by the group's local rank, cross group j starts on
    NIC j mod K, and g >= K groups keep every NIC busy (NCCL maps GPU j to its
    nearest NIC the same way). torch gives gloo groups no per-group device
    option, only the environment it reads when a group is made, so this sets
    it for the duration. Every member of a group must rotate alike (they do:
    the rotation is a property of the group, not of the rank).
    """
    names = os.environ.get(GLOO_IFNAME)
    nics = [n for n in (names or "").split(",") if n]
    if len(nics) < 2:
        yield
        return
    k = first % len(nics)
    os.environ[GLOO_IFNAME] = ",".join(nics[k:] + nics[:k])
    try:
        yield
    finally:
        os.environ[GLOO_IFNAME] = names  # type: ignore[assignment]


def resolve_backend(name: str, level: str) -> str:
    """Turn ``auto`` into nccl (CUDA present) or gloo, and check the choice can work."""
    if name not in BACKENDS:
        raise ValueError(f"{level}_backend={name!r} is not one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            f"{level}_backend='nccl' needs CUDA, but torch.cuda.is_available() is False: use 'gloo'"
        )
    return name


@dataclass
class CommGroups:
    """This rank's view of the groups: ``None`` where it is not a member or it was not built.

    - ``world``: every rank (the flat algorithm), on the inter-node backend;
    - ``intra``: the ranks of this rank's node;
    - ``leaders``: one rank per node (only set on leaders);
    - ``cross``: the ranks with this rank's local rank on every node (uniform
      nodes only; the sharded algorithm's inter-node phase).

    ``kinds`` says which of them were built: a job that runs one algorithm
    builds only the groups that algorithm talks over, since every gloo group
    holds its own connections, threads and buffers (flat alone: ``world``).
    """

    topology: Topology
    intra_backend: str
    inter_backend: str
    timeout: timedelta
    world: dist.ProcessGroup | None
    intra: dist.ProcessGroup | None
    leaders: dist.ProcessGroup | None
    cross: dist.ProcessGroup | None
    kinds: frozenset[str] = field(default=frozenset(GROUP_KINDS))
    # One box per set of groups, shared by copies (dataclasses.replace passes it on), holding the ordered stream.
    _stream_box: list[OrderedStream] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        topology: Topology,
        intra_backend: str = "auto",
        inter_backend: str = "auto",
        timeout_s: float = 300.0,
        kinds: Iterable[str] = GROUP_KINDS,
    ) -> "CommGroups":
        """Create the groups named in ``kinds`` (default: all).

        Collective: every rank calls it, with the same ``kinds``.
        """
        wanted = frozenset(kinds)
        unknown = sorted(wanted - set(GROUP_KINDS))
        if unknown:
            raise ValueError(f"group kinds {unknown} are not among {', '.join(GROUP_KINDS)}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
        if not dist.is_initialized():
            raise RuntimeError("CommGroups.build needs torch.distributed.init_process_group first")
        intra_b = resolve_backend(intra_backend, "intra")
        inter_b = resolve_backend(inter_backend, "inter")
        timeout = timedelta(seconds=timeout_s)
        world = intra = leaders_group = cross = None
        # Always in this order, so every rank creates the same groups in the same sequence.
        if "world" in wanted:
            world = dist.new_group(list(range(topology.world_size)), timeout=timeout, backend=inter_b)
        if "intra" in wanted:
            intra, _ = dist.new_subgroups_by_enumeration(
                [list(node) for node in topology.nodes], timeout=timeout, backend=intra_b
            )
        if "leaders" in wanted:
            leaders_group = dist.new_group(list(topology.leaders), timeout=timeout, backend=inter_b)
        if "cross" in wanted and topology.is_uniform:
            for j, ranks in enumerate(topology.cross_groups()):
                with gloo_nics_starting_at(j):  # rail-aligned: cross group j on NIC j mod K first
                    group = dist.new_group(list(ranks), timeout=timeout, backend=inter_b)
                if topology.rank in ranks:
                    cross = group
        return cls(
            topology=topology,
            intra_backend=intra_b,
            inter_backend=inter_b,
            timeout=timeout,
            world=world,
            intra=intra,
            leaders=leaders_group if topology.is_leader else None,
            cross=cross,
            kinds=wanted,
        )

    def inside_node(self) -> "CommGroups":
        """These groups seen as a job of one node, this rank's: its ``intra`` group only, with no inter-node
        level. What a node that trains on its own between meetings (comm=diloco's inner steps) shards its
        optimizer over; the copy shares the ordered stream."""
        if self.intra is None:
            raise ValueError("inside_node needs the intra-node group: build it with kinds including 'intra'")
        node = Topology(self.topology.rank, (self.topology.node_ranks,))
        return replace(self, topology=node, world=None, leaders=None, cross=None, kinds=frozenset({"intra"}))

    @property
    def gloo_only(self) -> bool:
        """Whether both levels run on gloo. gloo groups never wait on each other, so a collective may leave
        straight from backward beside those of the ordered stream; NCCL communicators used side by side need
        one order across all groups, so there every collective goes through the stream."""
        return self.intra_backend == "gloo" and self.inter_backend == "gloo"

    @property
    def stream(self) -> OrderedStream | None:
        """The ordered stream of these groups' collectives, or None if nothing has asked for one."""
        return self._stream_box[0] if self._stream_box else None

    def ordered_stream(self) -> OrderedStream:
        """The one stream that issues these groups' collectives off the caller's thread (made on first use).

        One per set of groups, not per DDP model or per communicator: every
        model and communicator on these groups then queues into the same FIFO,
        so the collectives leave every rank in one order (see
        :mod:`hybrid.core.comm.ordered_stream`).
        """
        with _STREAM_LOCK:
            if not self._stream_box:
                self._stream_box.append(OrderedStream(f"hybrid-comm-{self.topology.rank}"))
            return self._stream_box[0]

    def destroy(self) -> None:
        """Destroy the groups this rank is a member of (the default group stays)."""
        for group in {id(g): g for g in (self.world, self.intra, self.leaders, self.cross) if g}.values():
            dist.destroy_process_group(group)
