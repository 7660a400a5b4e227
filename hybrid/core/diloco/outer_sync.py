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
- ``sharded``: the node's workers split the parameters (whole tensors, balanced by size:
  :mod:`hybrid.core.diloco.outer_state`); worker j holds the global weights and outer optimizer state of its
  tensors only (about 1/g of them), averages their pseudo-gradient with worker j of every other node over
  its same-local-rank group (all shares side by side, over every worker's link), takes their outer step,
  and broadcasts the new weights inside its node (uniform nodes only).

With ``compression`` (``bf16``, ``fp16``, or ``fp8``: e4m3 with a scale per block,
:mod:`hybrid.core.diloco.codec`) the nodes' parts are all-gathered encoded instead of all-reduced, and
every rank sums the decoded parts in fp32.

With ``overlap`` a fragment's exchange runs in the background while every node takes its next inner steps,
and lands at the end of the ``overlap_steps``-th of them (a fixed delay, the same on every rank, so the result
does not depend on when the network delivers it): the outer step is taken on the global weights as without
overlap, and each node continues from the new global weights plus the inner steps it took meanwhile. Nodes
then differ by those steps after an outer step, as they do between syncs (Streaming DiLoCo's overlap, with the
local steps kept rather than mixed).

Both give every rank the same bits (one all-reduce per element, then copies or broadcasts),
and the outer step is the same deterministic update on every rank, so all
ranks hold identical weights after each sync. Nodes count equally, as DiLoCo
weighs its workers; with equal nodes, H = 1, an outer SGD with lr 1 and no
momentum, and plain SGD inside, this is exactly data-parallel SGD (the
pseudo-gradient is lr x the node's mean gradient).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from hybrid.core.comm.counters import PhaseCounters, allreduce_bytes, rooted_bytes
from hybrid.core.comm.groups import CommGroups
from hybrid.core.diloco.codec import CODECS, EncodedGather, wire_bytes
from hybrid.core.diloco.outer_state import load_optimizer_share, merge_shares, optimizer_share, owners

__all__ = ["INTER_MODES", "OuterSync", "PIECE_BYTES", "default_outer_optimizer"]

INTER_MODES = ("hierarchical", "sharded")
# A sync without overlap holds the pseudo-gradient of this much of the model at a time (whole tensors; a larger
# tensor is a piece of its own): rank 0's memory at a sync is the model's state plus a piece, not plus a copy.
PIECE_BYTES = 4 << 20


def default_outer_optimizer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The paper's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


@dataclass
class _Exchange:
    """One fragment's pseudo-gradient on its way among the nodes."""

    fragment: int
    due: int  # the inner step at whose end it lands
    delta: torch.Tensor  # 1-D fp32: this rank's tensors' pseudo-gradient, the mean among nodes once ``complete`` ran
    sent: torch.Tensor | None  # overlap: the whole fragment's local weights (fp32) when it left
    complete: Callable[[], None] | None  # waits for the exchange and writes the mean into delta; None: done


@dataclass
class _Plan:
    """What the outer loop does after one inner step, in order, and how many of those operations are done. Each
    operation is a transaction: its exchange among nodes completes (and, with ``transactional``, the node's
    workers agree on that) before it changes any state, so a failure leaves this rank as after the operations
    before it. Operations: ``("land", fragment, drifted)``, ``("sync", fragment)``, ``("start", fragment, due)``."""

    step: int
    ops: list[tuple[Any, ...]]
    done: int = 0


class _Started:
    """An average among one rank per node, in flight: a summing all-reduce, or an all-gather of encoded parts."""

    def __init__(self, values: torch.Tensor, group: dist.ProcessGroup, members: int, compression: str) -> None:
        self.members = members
        self.gather = EncodedGather(values, compression, group, members) if compression != "none" else None
        self.work = dist.all_reduce(values, group=group, async_op=True) if self.gather is None else None

    def mean_into(self, values: torch.Tensor) -> None:
        if self.gather is not None:
            self.gather.mean_into(values)
            return
        self.work.wait()
        values.div_(self.members)


class OuterSync:
    """The global weights, the outer optimizer and the exchange among nodes, for one model's parameters.

    ``step(inner_step)`` after every inner optimizer step (1-based count of steps taken): every
    ``sync_every``-th one syncs. ``finish(inner_step)`` at the end of training syncs whatever has moved since
    its last sync, so every rank ends with the same weights. ``outer_optimizer`` builds the outer optimizer
    from the global weights (a ``torch.optim`` class with its arguments bound, e.g.
    ``functools.partial(torch.optim.SGD, lr=0.7)``). ``counters``: the exchange's time and bytes, as phases
    ``inter_allreduce`` (among nodes) and ``intra_broadcast`` (the mean spread inside the node).
    ``piece_bytes``: a sync without overlap averages and applies the pseudo-gradient this much at a time.
    ``global_params``: the fp32 global weights this rank holds (of the tensors ``owned``: all of them with
    ``inter=hierarchical``, this worker's share with ``sharded``). Collective: every rank of the job constructs
    it and calls ``step`` with the same counts."""

    def __init__(self, params: Iterable[torch.Tensor], groups: CommGroups, *, sync_every: int,
                 outer_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = default_outer_optimizer,
                 inter: str = "hierarchical", fragments: int = 1, compression: str = "none",
                 overlap: bool = False, overlap_steps: int = 1, counters: PhaseCounters | None = None,
                 piece_bytes: int = PIECE_BYTES, transactional: bool = False) -> None:
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
        if overlap and (not isinstance(overlap_steps, int) or isinstance(overlap_steps, bool)
                        or not 1 <= overlap_steps <= sync_every // fragments):
            raise ValueError(f"overlap_steps={overlap_steps!r} must be an integer in 1..{sync_every // fragments} "
                             "(sync_every / fragments: an exchange lands before the next one leaves)")
        topology = groups.topology
        if groups.intra is None or (topology.is_leader and groups.leaders is None and inter == "hierarchical"):
            raise ValueError("OuterSync needs the intra and leaders groups (CommGroups.build with those kinds)")
        if inter == "sharded" and groups.cross is None:
            raise ValueError("inter=sharded needs uniform nodes and the cross groups (CommGroups kinds 'cross')")
        self.groups, self.sync_every, self.inter, self.compression = groups, sync_every, inter, compression
        self.overlap, self.counters = overlap, counters if counters is not None else PhaseCounters()
        self.delay = overlap_steps if overlap else 0  # inner steps between an exchange leaving and landing
        self.fragments = _fragments([p.numel() for p in self.params], fragments)
        nbytes = [p.numel() * 4 for p in self.params]
        # Who holds each tensor's outer state: every rank (hierarchical) or one worker of each node (sharded).
        self.owners = owners(self.fragments, nbytes, topology.local_world_size) if inter == "sharded" else None
        self.owned = [i for i in range(len(self.params)) if self.owners is None or self.owners[i] == topology.local_rank]
        # fp32 masters of the global weights of this rank's tensors, whatever the model's dtype: the outer step
        # runs on them.
        self._global = {i: self.params[i].detach().clone().float() for i in self.owned}
        self.global_params = [self._global[i] for i in self.owned]
        self.outer = outer_optimizer(self.global_params) if self.global_params else None
        self._index_of = {id(g): i for i, g in self._global.items()}
        # Transactional (recovery in place): a sync averages its whole fragment before it updates anything, so a
        # failed exchange leaves the state as before it (a fragment's copy of memory at a sync, not a piece's).
        self.transactional = transactional
        self._pieces = [[[i for i in run if i in self._global]] if transactional else
                        _pieces([i for i in run if i in self._global], [nbytes[i] for i in run if i in self._global],
                                piece_bytes) for run in self.fragments]
        self._plan = _Plan(0, [])
        self.syncs = 0
        self.last_pseudo_grad_norm = 0.0
        self.bytes_per_sync = self._bytes_per_sync()
        self._pending: list[_Exchange] = []
        self._clean = [True] * len(self.fragments)  # fragment f holds the same bits on every rank

    @property
    def identical_everywhere(self) -> bool:
        """Whether every rank holds the same weights now (after a sync of every fragment, nothing in flight)."""
        return all(self._clean) and not self._pending

    def step(self, inner_step: int, final: bool = False) -> bool:
        """After inner step ``inner_step`` (inner optimizer steps taken so far): land the exchanges due now and
        start (and, without overlap, land) those of the fragments whose turn it is; with ``final`` (the last
        step), then :meth:`finish`. Whether an outer step was taken."""
        self._clean = [False] * len(self._clean)  # the inner step moved every fragment on every node
        in_flight = [(e.fragment, e.due) for e in self._pending]
        ops: list[tuple[Any, ...]] = [("land", f, True) for f, due in in_flight if due <= inner_step]
        in_flight = [(f, due) for f, due in in_flight if due > inner_step]
        clean = list(self._clean)
        for f in range(len(self.fragments)):
            if inner_step % self.sync_every == self.offset(f):
                if self.overlap:
                    ops.append(("start", f, inner_step + self.delay))
                    in_flight.append((f, inner_step + self.delay))
                else:
                    ops.append(("sync", f))
                    clean[f] = True
        if final:
            ops += self._final_ops(inner_step, in_flight, clean)
        self._plan = _Plan(inner_step, ops)
        return self._run_plan()

    def finish(self, inner_step: int) -> None:
        """The end of training: land what is in flight (keeping the inner steps taken since it left, if any) and
        sync every fragment that has moved since its last sync, so that all ranks hold the same weights."""
        ops = self._final_ops(inner_step, [(e.fragment, e.due) for e in self._pending], list(self._clean))
        self._plan = _Plan(inner_step, ops)
        self._run_plan()

    def _final_ops(self, inner_step: int, in_flight: list[tuple[int, int]], clean: list[bool]) -> list[tuple[Any, ...]]:
        ops: list[tuple[Any, ...]] = []
        for f, due in in_flight:
            drifted = due - self.delay < inner_step
            ops.append(("land", f, drifted))
            clean[f] = not drifted
        return ops + [("sync", f) for f in range(len(self.fragments)) if not clean[f]]

    def _run_plan(self) -> bool:
        """The plan's operations not done yet, in order; whether one of them took an outer step."""
        plan, stepped = self._plan, False
        while plan.done < len(plan.ops):
            op = plan.ops[plan.done]
            if op[0] == "land":
                exchange = next(e for e in self._pending if e.fragment == op[1])
                self._land(exchange, drifted=op[2])
                self._pending.remove(exchange)
            elif op[0] == "sync":
                self._sync_now(op[1])
            else:
                self._start(op[1], op[2])
            stepped |= op[0] != "start"
            plan.done += 1
        return stepped

    def resume(self) -> bool:
        """The rest of the interrupted step's plan (recovery in place: over the new groups, on every rank)."""
        return self._run_plan()

    def begin_at(self, inner_step: int) -> None:
        """Continue after inner step ``inner_step`` with nothing of it left to do (a resume from a checkpoint)."""
        self._plan = _Plan(inner_step, [])

    @property
    def version(self) -> tuple[int, int]:
        """(the last inner step the outer loop was told of, minus the operations of its plan not yet done): the
        further along, the greater."""
        return self._plan.step, self._plan.done - len(self._plan.ops)

    def offset(self, fragment: int) -> int:
        """Where in each interval ``fragment`` syncs: (f + 1) H / F mod H (the last fragment at H, i.e. 0)."""
        return (fragment + 1) * self.sync_every // len(self.fragments) % self.sync_every

    @torch.no_grad()
    def sync(self, fragment: int = 0) -> None:
        """Average one fragment's pseudo-gradient among nodes, take an outer step on it, continue every worker
        from its result (with one fragment: all the parameters), now, whatever the schedule."""
        self._sync_now(fragment)

    @torch.no_grad()
    def _start(self, fragment: int, due: int) -> _Exchange:
        """This rank's share of ``fragment``'s pseudo-gradient (global minus local weights) sent on its way, to
        land at the end of inner step ``due`` (overlap: the whole share travels while the inner steps go on)."""
        chosen = self.fragments[fragment]
        local = torch.cat([self.params[i].detach().float().reshape(-1) for i in chosen])
        delta = self._pseudo_grad(self._mine(fragment))
        exchange = _Exchange(fragment, due, delta, local, self._start_average(delta) if delta.numel() else None)
        self._pending.append(exchange)
        return exchange

    @torch.no_grad()
    def _sync_now(self, fragment: int) -> None:
        """Sync ``fragment`` at once, a piece of at most ``piece_bytes`` at a time: its pseudo-gradient averaged
        among nodes, the outer step, every worker continued from the new global weights. Only one piece's
        pseudo-gradient is held at a time, so a sync costs a piece of memory, not a copy of the model. The outer
        optimizer steps each piece's parameters on their own (torch's optimizers update parameters one by one
        and skip those without a gradient), and an all-reduce sums each element alike however the buffer is cut,
        so the result is the same as one exchange of the whole fragment."""
        squares, norm = 0.0, None
        for piece in self._pieces[fragment]:
            delta = self._pseudo_grad(piece)
            complete = self._start_average(delta) if delta.numel() else None
            if complete is not None:
                complete()
            squares += float(delta.norm()) ** 2
            if self.transactional:  # one piece: the node's workers agree each share arrived before any update
                norm = self._node_norm(squares)
            self._outer_step(piece, delta)
        self._spread(self.fragments[fragment], None)
        self.last_pseudo_grad_norm = norm if norm is not None else self._node_norm(squares)
        self._clean[fragment] = True
        self.syncs += 1

    def _mine(self, fragment: int) -> list[int]:
        return [i for i in self.fragments[fragment] if i in self._global]

    def _pseudo_grad(self, chosen: list[int]) -> torch.Tensor:
        """Global minus local weights of the tensors ``chosen`` (this rank's), flat fp32, in one buffer."""
        delta = torch.empty(sum(self.params[i].numel() for i in chosen), dtype=torch.float32,
                            device=self.params[0].device)
        offset = 0
        for i in chosen:
            g, n = self._global[i], self._global[i].numel()
            torch.sub(g.reshape(-1), self.params[i].detach().reshape(-1).float(), out=delta[offset:offset + n])
            offset += n
        return delta

    @torch.no_grad()
    def _land(self, exchange: _Exchange, drifted: bool) -> None:
        """Take the outer step on the mean pseudo-gradient of an exchange that travelled in the background and
        continue from the new global weights (plus the inner steps taken since it left, where ``drifted``)."""
        self._complete(exchange)
        self.last_pseudo_grad_norm = self._node_norm(float(exchange.delta.norm()) ** 2)
        self._outer_step(self._mine(exchange.fragment), exchange.delta)
        self._spread(self.fragments[exchange.fragment], exchange.sent if drifted else None)
        self._clean[exchange.fragment] = not drifted
        self.syncs += 1

    def _outer_step(self, chosen: list[int], delta: torch.Tensor) -> None:
        """The outer optimizer's step on this rank's tensors ``chosen`` with their mean pseudo-gradient ``delta``."""
        if not chosen:
            return
        offset = 0
        for i in chosen:
            g = self._global[i]
            g.grad = delta[offset:offset + g.numel()].view_as(g)
            offset += g.numel()
        self.outer.step()  # torch's optimizers skip parameters without a gradient: the other tensors
        for i in chosen:
            self._global[i].grad = None

    def _spread(self, chosen: list[int], sent: torch.Tensor | None) -> None:
        """Every worker continues the tensors ``chosen`` (a fragment, in order) from their new global weights,
        plus what it moved since ``sent`` (the fragment's flat local weights when its exchange left), where
        given. Sharded: each tensor's owner broadcasts it inside the node, in the model's dtype (the same bits
        its own copy gets), or in fp32 where the workers add their own drift to it."""
        owners, start = self.owners, time.perf_counter()
        topology, offset, moved = self.groups.topology, 0, 0
        for i in chosen:
            p, g = self.params[i].detach(), self._global.get(i)
            drift = None if sent is None else sent[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            if owners is not None and sent is None:
                if g is not None:
                    p.copy_(g)
                dist.broadcast(p, src=topology.node_ranks[owners[i]], group=self.groups.intra)
                moved += p.nbytes
                continue
            if owners is not None:
                g = g if g is not None else torch.empty(p.shape, dtype=torch.float32, device=p.device)
                dist.broadcast(g, src=topology.node_ranks[owners[i]], group=self.groups.intra)
                moved += g.nbytes
            p.copy_(g if drift is None else g + (p.float() - drift))  # keep the inner steps taken meanwhile
        if owners is not None:
            self.counters.add("intra_broadcast", time.perf_counter() - start,
                              rooted_bytes(moved, topology.local_world_size), start)

    def _node_norm(self, squares: float) -> float:
        """The pseudo-gradient's norm from this rank's sum of squares: summed over the node's shares (sharded)."""
        if self.owners is None or self.groups.topology.local_world_size == 1:
            return math.sqrt(squares)
        # On the model's device: the node's group is NCCL's on GPUs, which takes no CPU tensor.
        total = torch.tensor([squares], dtype=torch.float64, device=self.params[0].device)
        dist.all_reduce(total, group=self.groups.intra)
        return math.sqrt(float(total))

    def _complete(self, exchange: _Exchange) -> None:
        if exchange.complete is not None:
            exchange.complete()
            exchange.complete = None

    def _start_average(self, delta: torch.Tensor) -> Callable[[], None] | None:
        """Start averaging ``delta`` among nodes; the function that waits for it and leaves the mean in ``delta``
        (None: one node, nothing to average). Hierarchical: on every rank of the node, through its leader.
        Sharded: this rank's share, with the same-local-rank worker of every other node."""
        topology = self.groups.topology
        n, g = topology.nnodes, topology.local_world_size
        if n == 1:
            return None
        if self.inter == "hierarchical":
            started = self._start_inter(delta, self.groups.leaders) if topology.is_leader else None

            def complete_hierarchical() -> None:
                if started is not None:
                    self._timed("inter_allreduce", self._inter_bytes(delta.numel()), lambda: started.mean_into(delta))
                if g > 1:
                    self._timed("intra_broadcast", rooted_bytes(delta.nbytes, g),
                                lambda: dist.broadcast(delta, src=topology.leader, group=self.groups.intra))

            return complete_hierarchical
        started = self._start_inter(delta, self.groups.cross)
        return lambda: self._timed("inter_allreduce", self._inter_bytes(delta.numel()),
                                   lambda: started.mean_into(delta))

    def _start_inter(self, values: torch.Tensor, group: dist.ProcessGroup) -> _Started:
        return _Started(values, group, self.groups.topology.nnodes, self.compression)

    def _inter_bytes(self, numel: int) -> int:
        """What one rank sends among nodes for ``numel`` fp32 values: a ring all-reduce's 2(n-1)/n of them, or
        their encoded part to each of the n-1 others."""
        n = self.groups.topology.nnodes
        if self.compression == "none":
            return allreduce_bytes(numel * 4, n)
        return (n - 1) * wire_bytes(numel, self.compression)

    def _timed(self, phase: str, nbytes: int, wait: Callable[[], Any]) -> None:
        start = time.perf_counter()
        wait()
        self.counters.add(phase, time.perf_counter() - start, nbytes, start)

    def _bytes_per_sync(self) -> int:
        """Bytes each node puts on its inter-node link per interval of H steps, all fragments together (sharded:
        every worker's share)."""
        if self.owners is None:
            return self._inter_bytes(sum(p.numel() for p in self.params))
        shares = [0] * self.groups.topology.local_world_size
        for i, owner in enumerate(self.owners):
            shares[owner] += self.params[i].numel()
        return sum(self._inter_bytes(share) for share in shares if share)

    def held_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's outer state as it stands, for recovery in place, without a collective (an exchange in
        flight is not waited for: it is started again over the new groups, from what it sent). Two parts:
        ``shared``, the same on every node (this rank's share of the global weights and outer optimizer state,
        the schedule's place and the interrupted step's plan), and ``node``, this node's own (the exchanges in
        flight, with their fragments' weights when they left). Refers to the live tensors, as :meth:`state_dict`."""
        plan = self._plan
        shared = {"sync_every": self.sync_every, "fragments": len(self.fragments), "syncs": self.syncs,
                  "clean": list(self._clean), "plan": {"step": plan.step, "ops": list(plan.ops), "done": plan.done},
                  "share": {"global": dict(self._global), "outer": optimizer_share(self.outer, self._index_of)}}
        node = {"pending": [{"fragment": e.fragment, "due": e.due, "sent": e.sent} for e in self._pending]}
        return shared, node

    def load_held(self, shared: dict[str, Any], node: dict[str, Any]) -> None:
        """Continue from a :meth:`held_state` (this rank's, or a peer's of the same share): every exchange that
        was in flight starts again over this rank's groups, with the pseudo-gradient it carried (the global
        weights minus the weights it sent), to land when it was due; :meth:`resume` then does what the
        interrupted step had left. Collective where an exchange was in flight."""
        saved = (shared["sync_every"], shared["fragments"])
        if saved != (self.sync_every, len(self.fragments)):
            raise ValueError(f"the held state synced every {saved[0]} steps in {saved[1]} fragment(s), this run "
                             f"every {self.sync_every} in {len(self.fragments)}")
        merged = merge_shares([shared["share"]])
        with torch.no_grad():
            for i, g in self._global.items():
                g.copy_(merged["global"][i])
        load_optimizer_share(self.outer, self._index_of, merged)
        self.syncs, self._clean = int(shared["syncs"]), list(shared["clean"])
        plan = shared["plan"]
        self._plan = _Plan(int(plan["step"]), [tuple(op) for op in plan["ops"]], int(plan["done"]))
        self._pending = []
        device = self.params[0].device
        for e in node["pending"]:
            sent = e["sent"].to(device)
            delta = self._sent_delta(e["fragment"], sent)
            self._pending.append(_Exchange(e["fragment"], e["due"], delta, sent,
                                           self._start_average(delta) if delta.numel() else None))

    def _sent_delta(self, fragment: int, sent: torch.Tensor) -> torch.Tensor:
        """This rank's share of a fragment's pseudo-gradient as it left: global weights minus ``sent`` (the
        fragment's flat fp32 weights then), the same bits :meth:`_start` computed."""
        parts, offset = [], 0
        for i in self.fragments[fragment]:
            n = self.params[i].numel()
            if i in self._global:
                parts.append(self._global[i].reshape(-1) - sent[offset:offset + n])
            offset += n
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32, device=sent.device)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to resume bitwise anywhere inside an interval: the schedule's place and the
        exchanges in flight (their fragments' weights when they left, which differ per node), and ``shares``:
        this rank's share of the outer state (:mod:`hybrid.core.diloco.outer_state`; the same on every node).
        Collective where an exchange is in flight (overlap): it is waited for, and its mean saved. Like torch's
        own ``state_dict``, it refers to the live tensors (a checkpoint writes them at once; copy it to keep it
        past the next step)."""
        for exchange in self._pending:
            self._complete(exchange)
        deltas = []
        for e in self._pending:
            mine, offset = {}, 0
            for i in self._mine(e.fragment):
                mine[i] = e.delta[offset:offset + self.params[i].numel()].clone()
                offset += self.params[i].numel()
            deltas.append(mine)
        share = {"global": dict(self._global), "outer": optimizer_share(self.outer, self._index_of),
                 "deltas": deltas}
        return {"syncs": self.syncs, "sync_every": self.sync_every, "fragments": len(self.fragments),
                "clean": list(self._clean), "shares": [share],
                "pending": [{"fragment": e.fragment, "due": e.due,
                             "sent": None if e.sent is None else e.sent.clone()} for e in self._pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state whose ``shares`` may come from any layout (each rank takes the tensors it holds now), or
        one saved before the outer state was shared (whole, ``global_params``)."""
        saved = (state["sync_every"], state.get("fragments", 1))
        if saved != (self.sync_every, len(self.fragments)):
            raise ValueError(f"the checkpoint synced every {saved[0]} steps in {saved[1]} fragment(s), this run "
                             f"every {self.sync_every} in {len(self.fragments)}: resume with the same schedule")
        merged = merge_shares(state["shares"] if "shares" in state else [self._whole_share(state)])
        device = self.params[0].device
        with torch.no_grad():
            for i, g in self._global.items():
                g.copy_(merged["global"][i])
        load_optimizer_share(self.outer, self._index_of, merged)
        self.syncs = int(state["syncs"])
        self._clean = list(state.get("clean", [False] * len(self.fragments)))
        self._pending = []
        for k, e in enumerate(state.get("pending", [])):
            mine = [merged["deltas"][k][i].reshape(-1) for i in self._mine(e["fragment"])]
            delta = torch.cat(mine).to(device) if mine else torch.empty(0, device=device)
            self._pending.append(_Exchange(e["fragment"], e["due"], delta,
                                           None if e["sent"] is None else e["sent"].to(device), None))

    def _whole_share(self, state: dict[str, Any]) -> dict[str, Any]:
        """A state saved with the whole outer state (every tensor's, ``global_params``) as one share."""
        outer = {**state["outer"], "positions": list(range(len(state["global_params"])))}
        deltas = []
        for e in state.get("pending", []):
            mine, offset = {}, 0
            for i in self.fragments[e["fragment"]]:
                mine[i] = e["delta"][offset:offset + self.params[i].numel()]
                offset += self.params[i].numel()
            deltas.append(mine)
        return {"global": dict(enumerate(state["global_params"])), "outer": outer, "deltas": deltas}


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


def _pieces(run: list[int], nbytes: list[int], limit: int) -> list[list[int]]:
    """The tensors ``run`` cut into runs of consecutive ones of at most ``limit`` bytes together (a tensor larger
    than that alone), in order."""
    pieces: list[list[int]] = []
    total = 0
    for i, size in zip(run, nbytes, strict=True):
        if not pieces or total + size > limit:
            pieces.append([])
            total = 0
        pieces[-1].append(i)
        total += size
    return pieces
