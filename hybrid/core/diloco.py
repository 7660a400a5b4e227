"""DiLoCo's outer loop across nodes: workers of a node stay in step every step, nodes meet every H steps.

Hierarchical in time (Douillard et al., "DiLoCo", arXiv 2311.08105): each node
is one DiLoCo worker. Inside it, the gradients are averaged every step over
the fast intra-node link (the caller's inner loop does that: intra-node
all-reduce, then its inner optimizer), so the workers of a node hold the same
weights after every step. Across nodes nothing travels for ``sync_every`` (H)
inner steps; then every node's *pseudo-gradient* (the global weights of the
last sync minus the node's weights now) is averaged among the nodes, and an
outer optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9 in the
paper) moves the global weights by it; every worker then continues from them.
The slow link carries S bytes per node once every H steps instead of every
step.

Streaming (Douillard et al., "Streaming DiLoCo", arXiv 2501.18512): with ``fragments`` F the parameters
are cut into F fragments of about equal size (whole tensors, in order), each synced every H steps but at
staggered steps, fragment f at the steps s with s = (f + 1) H / F (mod H): the same bytes per H steps, a
1/F share of them at a time.

The average travels one of two ways, as hybrid's own algorithms do:

- ``hierarchical``: the node leaders all-reduce the whole pseudo-gradient
  (they hold their node's, identical on every worker of it), and each leader
  broadcasts the mean inside its node;
- ``sharded``: worker j of every node all-reduces the j-th of g shards over
  its same-local-rank group (all shards side by side, over every worker's
  link), and the node all-gathers the shards (uniform nodes only).

With ``compression`` (``bf16``, ``fp16``, or ``fp8``: e4m3 with a scale per block,
:mod:`hybrid.core.pseudo_grad_codec`) the nodes' parts are all-gathered encoded instead of all-reduced, and
every rank sums the decoded parts in fp32.

Both give every rank the same bits (one all-reduce per element, then copies),
and the outer step is the same deterministic update on every rank, so all
ranks hold identical weights after each sync. Nodes count equally, as DiLoCo
weighs its workers; with equal nodes, H = 1, an outer SGD with lr 1 and no
momentum, and plain SGD inside, this is exactly data-parallel SGD (the
pseudo-gradient is lr x the node's mean gradient).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from hybrid.core.comm.groups import CommGroups
from hybrid.core.pseudo_grad_codec import CODECS, average_encoded, wire_bytes

__all__ = ["INTER_MODES", "OuterSync", "default_outer_optimizer"]

INTER_MODES = ("hierarchical", "sharded")


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class OuterSync:
    """The global weights, the outer optimizer and the exchange among nodes, for one model's parameters.

    ``step(inner_step)`` after every inner optimizer step (1-based count of steps taken): every
    ``sync_every``-th one syncs. ``outer_optimizer`` builds the outer optimizer from the global weights (a
    ``torch.optim`` class with its arguments bound, e.g. ``functools.partial(torch.optim.SGD, lr=0.7)``).
    Collective: every rank of the job constructs it and calls ``step`` with the same counts."""

    def __init__(self, params: Iterable[torch.Tensor], groups: CommGroups, *, sync_every: int,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = default_outer_optimizer,
                 inter: str = "hierarchical", fragments: int = 1, compression: str = "none") -> None:
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(f"sync_every={sync_every!r} must be an integer >= 1 (inner steps between syncs)")
        if inter not in INTER_MODES:
            raise ValueError(f"inter={inter!r} is not one of {', '.join(INTER_MODES)}")
        if compression not in CODECS:
            raise ValueError(f"compression={compression!r} is not one of {', '.join(CODECS)}")
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("OuterSync needs at least one parameter")
        if not isinstance(fragments, int) or isinstance(fragments, bool) or not 1 <= fragments <= len(self.params) \
                or sync_every % fragments:
            raise ValueError(f"fragments={fragments!r} must be an integer in 1..{len(self.params)} (the parameter "
                             f"tensors) that divides sync_every={sync_every}")
        topology = groups.topology
        if groups.intra is None or (topology.is_leader and groups.leaders is None and inter == "hierarchical"):
            raise ValueError("OuterSync needs the intra and leaders groups (CommGroups.build with those kinds)")
        if inter == "sharded" and groups.cross is None:
            raise ValueError("inter=sharded needs uniform nodes and the cross groups (CommGroups kinds 'cross')")
        self.groups, self.sync_every, self.inter, self.compression = groups, sync_every, inter, compression
        # fp32 masters of the global weights, whatever the model's dtype: the outer step runs on them.
        self.global_params = [p.detach().clone().float() for p in self.params]
        self.outer = outer_optimizer(self.global_params)
        self.fragments = _fragments([p.numel() for p in self.params], fragments)
        self.syncs = 0
        self.last_pseudo_grad_norm = 0.0
        self.bytes_per_sync = self._bytes_per_sync()

    def step(self, inner_step: int) -> bool:
        """Sync the fragments whose turn ``inner_step`` (inner optimizer steps taken so far) is; whether any did."""
        due = [f for f in range(len(self.fragments)) if inner_step % self.sync_every == self.offset(f)]
        for f in due:
            self.sync(f)
        return bool(due)

    def offset(self, fragment: int) -> int:
        """Where in each interval ``fragment`` syncs: (f + 1) H / F mod H (the last fragment at H, i.e. 0)."""
        return (fragment + 1) * self.sync_every // len(self.fragments) % self.sync_every

    @torch.no_grad()
    def sync(self, fragment: int = 0) -> None:
        """Average one fragment's pseudo-gradient among nodes, take an outer step on it, continue every worker
        from its result (with one fragment: all the parameters)."""
        chosen = self.fragments[fragment]
        pairs = [(self.global_params[i], self.params[i]) for i in chosen]
        delta = torch.cat([(g - p.detach().float()).reshape(-1) for g, p in pairs])
        self._average_among_nodes(delta)
        self.last_pseudo_grad_norm = float(delta.norm())
        offset = 0
        for g, _ in pairs:
            g.grad = delta[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
        self.outer.step()  # torch's optimizers skip parameters without a gradient: the other fragments
        for g, p in pairs:
            p.copy_(g)
            g.grad = None
        self.syncs += 1

    def _average_among_nodes(self, delta: torch.Tensor) -> None:
        topology = self.groups.topology
        if topology.nnodes == 1:
            return
        if self.inter == "hierarchical":
            if topology.is_leader:
                self._average(delta, self.groups.leaders)
            dist.broadcast(delta, src=topology.leader, group=self.groups.intra)
            return
        g = topology.local_world_size
        size = -(-delta.numel() // g)  # the shard length, the last one padded
        padded = torch.zeros(size * g, dtype=delta.dtype, device=delta.device)
        padded[:delta.numel()] = delta
        shards = list(padded.split(size))
        mine = shards[topology.local_rank].clone()
        self._average(mine, self.groups.cross)
        dist.all_gather(shards, mine, group=self.groups.intra)
        delta.copy_(torch.cat(shards)[:delta.numel()])

    def _average(self, values: torch.Tensor, group: dist.ProcessGroup) -> None:
        """The mean of ``values`` over ``group``, one rank per node: all-reduced, or all-gathered encoded."""
        nnodes = self.groups.topology.nnodes
        if self.compression == "none":
            dist.all_reduce(values, group=group)
            values.div_(nnodes)
        else:
            average_encoded(values, self.compression, group, nnodes)

    def _bytes_per_sync(self) -> int:
        """Bytes each node puts on its inter-node link per interval of H steps, all fragments together (a ring
        all-reduce sends 2(n-1)/n of its input; a ring all-gather (n-1) parts)."""
        n = self.groups.topology.nnodes
        numel = sum(g.numel() for g in self.global_params)
        if n == 1:
            return 0
        if self.compression == "none":
            return int(2 * (n - 1) / n * numel * 4)
        return (n - 1) * wire_bytes(numel, self.compression)  # an all-gather: its part to each other node

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume bitwise anywhere inside an interval."""
        return {"global_params": [g.clone() for g in self.global_params], "outer": self.outer.state_dict(),
                "syncs": self.syncs, "sync_every": self.sync_every, "fragments": len(self.fragments)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["sync_every"], state.get("fragments", 1))
        if saved != (self.sync_every, len(self.fragments)):
            raise ValueError(f"the checkpoint synced every {saved[0]} steps in {saved[1]} fragment(s), this run "
                             f"every {self.sync_every} in {len(self.fragments)}: resume with the same schedule")
        with torch.no_grad():
            for g, saved in zip(self.global_params, state["global_params"], strict=True):
                g.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        self.syncs = int(state["syncs"])



def _fragments(sizes: list[int], count: int) -> list[list[int]]:
    """``count`` runs of consecutive tensor indices of about equal total size, none empty (greedy: a run closes
    once it reaches its share of what is left)."""
    runs: list[list[int]] = []
    start, left = 0, sum(sizes)
    for k in range(count, 0, -1):
        share, run, total = left / k, [], 0
        while start < len(sizes) and (not run or (total < share and len(sizes) - start > k - 1)):
            run.append(start)
            total += sizes[start]
            start += 1
        runs.append(run)
        left -= total
    runs[-1].extend(range(start, len(sizes)))
    return runs
