"""Who is where: nodes, local ranks and node leaders of a data-parallel job.

The two-level communicator needs to know, for every global rank, which node it
lives on and its position inside that node. torchrun (and :mod:`hybrid.runtime.launch`)
export that per process (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK`` ...), but each
process only sees its own line. :func:`discover_topology` exchanges those lines
once at start-up so every rank holds the same picture, which is what makes
uneven nodes (3 workers on one node, 1 on another) work.

The core of this module, :func:`build_topology`, is pure: it turns the gathered
lines into a validated :class:`Topology` and fails early with the real numbers,
so a wrong layout is reported before any process group is created.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "Layout",
    "RankInfo",
    "Topology",
    "WorkerEnv",
    "build_topology",
    "check_world_size",
    "discover_topology",
]


@dataclass(frozen=True)
class Layout:
    """A declared cluster shape: the number of workers on each node."""

    node_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.node_sizes:
            raise ValueError("layout has no nodes: give at least one node, e.g. '1x1'")
        for i, size in enumerate(self.node_sizes):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"node {i} has {size!r} workers: every node needs at least 1")

    @classmethod
    def uniform(cls, nnodes: int, nproc_per_node: int) -> "Layout":
        if nnodes < 1 or nproc_per_node < 1:
            raise ValueError(
                f"nnodes ({nnodes}) and nproc_per_node ({nproc_per_node}) must both be >= 1"
            )
        return cls((nproc_per_node,) * nnodes)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse ``'2x4'`` (2 nodes of 4) or ``'3,1'`` (uneven: nodes of 3 and 1)."""
        spec = text.strip().lower()
        uniform = re.fullmatch(r"(\d+)x(\d+)", spec)
        if uniform:
            return cls.uniform(int(uniform.group(1)), int(uniform.group(2)))
        if re.fullmatch(r"\d+(,\d+)*", spec):
            return cls(tuple(int(part) for part in spec.split(",")))
        raise ValueError(
            f"layout {text!r} is not understood: use NNODESxNPROC (e.g. '2x4') "
            "or the workers per node separated by commas (e.g. '3,1')"
        )

    @property
    def nnodes(self) -> int:
        return len(self.node_sizes)

    @property
    def world_size(self) -> int:
        return sum(self.node_sizes)

    @property
    def is_uniform(self) -> bool:
        return len(set(self.node_sizes)) == 1

    def __str__(self) -> str:
        if self.is_uniform:
            return f"{self.nnodes}x{self.node_sizes[0]}"
        return ",".join(str(s) for s in self.node_sizes)


@dataclass(frozen=True)
class RankInfo:
    """What one process knows about itself (torchrun's per-process environment)."""

    rank: int
    node: int  # GROUP_RANK: the node (agent) index
    local_rank: int
    local_world_size: int


@dataclass(frozen=True)
class WorkerEnv:
    """This process's distributed environment, as torchrun exports it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node: int

    @classmethod
    def from_env(cls, environ: "os._Environ[str] | dict[str, str] | None" = None) -> "WorkerEnv":
        env = os.environ if environ is None else environ
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        missing = [n for n in names if n not in env]
        if missing:
            raise RuntimeError(
                f"{', '.join(missing)} not set: run under torchrun or hybrid.runtime.launch "
                "(they export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK)"
            )
        values = {}
        for name in names:
            try:
                values[name] = int(env[name])
            except ValueError:
                raise RuntimeError(f"{name}={env[name]!r} is not an integer") from None
        return cls(
            rank=values["RANK"],
            world_size=values["WORLD_SIZE"],
            local_rank=values["LOCAL_RANK"],
            local_world_size=values["LOCAL_WORLD_SIZE"],
            node=values["GROUP_RANK"],
        )

    def info(self) -> RankInfo:
        return RankInfo(self.rank, self.node, self.local_rank, self.local_world_size)


@dataclass(frozen=True)
class Topology:
    """The validated 2-D mesh (inter-node x intra-node) seen from one rank.

    ``nodes[i]`` lists the global ranks of node ``i`` ordered by local rank; the
    first of them is the node's leader. Nodes are numbered 0..nnodes-1 in the
    order of the launcher's node ids, whatever those ids were.
    """

    rank: int
    nodes: tuple[tuple[int, ...], ...]

    @property
    def world_size(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(len(n) for n in self.nodes)

    @property
    def layout(self) -> Layout:
        return Layout(self.node_sizes)

    @property
    def is_uniform(self) -> bool:
        return self.layout.is_uniform

    @property
    def node(self) -> int:
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        for index, members in enumerate(self.nodes):
            if rank in members:
                return index
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size} ranks")

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node].index(self.rank)

    @property
    def local_world_size(self) -> int:
        return len(self.nodes[self.node])

    @property
    def node_ranks(self) -> tuple[int, ...]:
        """Global ranks sharing this rank's node (including itself)."""
        return self.nodes[self.node]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(members[0] for members in self.nodes)

    @property
    def leader(self) -> int:
        return self.nodes[self.node][0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    def cross_groups(self) -> tuple[tuple[int, ...], ...]:
        """Same-local-rank groups: ``cross_groups()[j]`` holds local rank j of every node.

        Only defined for uniform nodes: with nodes of unequal size the shards of
        the sharded algorithm would not line up across nodes.
        """
        if not self.is_uniform:
            raise ValueError(f"cross groups need equal nodes, got node sizes {list(self.node_sizes)}")
        return tuple(tuple(members[j] for members in self.nodes) for j in range(self.node_sizes[0]))

    def describe(self) -> str:
        return f"{self.nnodes} node(s) of sizes {list(self.node_sizes)} (world {self.world_size})"


def check_world_size(expected: Layout, world_size: int) -> None:
    """Raise if the declared layout does not add up to the launched world size."""
    if expected.world_size == world_size:
        return
    if expected.is_uniform:
        declared = (
            f"nnodes ({expected.nnodes}) x nproc_per_node ({expected.node_sizes[0]}) "
            f"= {expected.world_size}"
        )
    else:
        declared = f"node sizes {list(expected.node_sizes)} sum to {expected.world_size}"
    raise ValueError(f"{declared} != WORLD_SIZE ({world_size})")


def build_topology(rank: int, infos: Sequence[RankInfo], expected: Layout | None = None) -> Topology:
    """Validate everyone's :class:`RankInfo` and arrange them into a :class:`Topology`.

    ``infos`` must hold one entry per global rank (as gathered from all ranks).
    ``expected`` is the layout the user declared; any disagreement with what the
    launcher actually started is an error that names both numbers.
    """
    world = len(infos)
    if expected is not None:
        check_world_size(expected, world)
    ranks = sorted(info.rank for info in infos)
    if ranks != list(range(world)):
        raise ValueError(f"ranks {ranks} are not 0..{world - 1}: each rank must appear exactly once")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1}")

    by_node: dict[int, list[RankInfo]] = {}
    for info in infos:
        by_node.setdefault(info.node, []).append(info)
    nodes: list[tuple[int, ...]] = []
    for node_id in sorted(by_node):
        members = sorted(by_node[node_id], key=lambda i: i.local_rank)
        local_ranks = [m.local_rank for m in members]
        if local_ranks != list(range(len(members))):
            raise ValueError(
                f"node {node_id} has local ranks {local_ranks}: expected 0..{len(members) - 1}"
            )
        for m in members:
            if m.local_world_size != len(members):
                raise ValueError(
                    f"rank {m.rank} says LOCAL_WORLD_SIZE={m.local_world_size} "
                    f"but node {node_id} has {len(members)} rank(s)"
                )
        nodes.append(tuple(m.rank for m in members))

    topology = Topology(rank=rank, nodes=tuple(nodes))
    if expected is not None and sorted(expected.node_sizes) != sorted(topology.node_sizes):
        raise ValueError(
            f"declared layout {expected} (node sizes {list(expected.node_sizes)}) != "
            f"launched layout {topology.layout} (node sizes {list(topology.node_sizes)})"
        )
    return topology


def discover_topology(env: WorkerEnv | None = None, expected: Layout | None = None) -> Topology:
    """Exchange every rank's :class:`RankInfo` over the default group and build the topology.

    Collective: every rank must call it. The default process group must exist.
    """
    import torch.distributed as dist

    env = WorkerEnv.from_env() if env is None else env
    if not dist.is_initialized():
        raise RuntimeError("discover_topology needs torch.distributed.init_process_group first")
    if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
        raise ValueError(
            f"process group has rank {dist.get_rank()} of {dist.get_world_size()} but the "
            f"environment says RANK={env.rank} WORLD_SIZE={env.world_size}"
        )
    if expected is not None:
        # Fail before the exchange: every rank sees the same mismatch.
        check_world_size(expected, env.world_size)
    gathered: list[RankInfo | None] = [None] * env.world_size
    dist.all_gather_object(gathered, env.info())
    infos = [info for info in gathered if info is not None]
    return build_topology(env.rank, infos, expected)
