"""After a membership change in place, each worker's state from itself or from a live peer, never from disk.

A survivor of a lost node still holds its own state as of the last step it completed
(:mod:`hybrid.app.state.in_place`), and most of it is what it needs to go on: in the every-step modes every
replica is the same bits, a node-sharded optimizer's shard ``j`` lives on worker ``j`` of every node, and a
DiLoCo node keeps its own weights between syncs while the outer state is the same on every node. So the state
is held in *parts*, each with who else holds an interchangeable copy of it (:func:`holdings_of`):

- ``run``: the schedule, the step, the data position, the RNG, the layout history (and comm=adaptive's mode and
  switches); the same on every worker;
- ``model`` and ``optimizer``: the same on every worker (every-step modes), a shard of the optimizer the same on
  the workers of one local rank (``comm.shard_optimizer``; comm=hsdp: of the model too), or a node's own (DiLoCo's weights and inner
  optimizer, with ``node_outer``: its exchanges in flight);
- ``outer``: DiLoCo's global weights and outer optimizer state, the same on every worker (``inter=hierarchical``)
  or on the workers of one local rank (``inter=sharded``: a share each).

The workers of the new group say what they hold and as of which step (:func:`assemble`: one all-gather); the
one furthest along (the lowest rank among equals) is the *source*, its version the target and its kind of state
(:data:`KINDS`; comm=adaptive's ranks may stand on either side of a switch) the one everyone continues in. A
worker keeps each part it holds as of the target; for any other part (it is behind, or its node has just joined)
it receives a copy from the lowest rank that holds the same part as of the target (:func:`plan_transfers`),
point to point over the new default group. Where no such copy exists, a node's own part may be stood in for by the source
node's (a DiLoCo node behind the others continues from the most advanced node's weights, as a returning node
does); a shard may not: without one, recovery fails in one line. What moved, and how many bytes, is said in
one status line on rank 0.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from hybrid.core.units import human_bytes

__all__ = ["JOB", "KINDS", "Offer", "assemble", "holdings_of", "plan_transfers"]

JOB: tuple[Any, ...] = ("job",)  # every worker of the job holds the same
# How a run's state is held, which decides its parts and who holds copies of each (:func:`holdings_of`). DiLoCo's
# ``+zero``: its inner optimizer sharded over the node's workers (comm.shard_optimizer).
KINDS = ("replicated", "node_sharded", "sharded_model", "diloco", "diloco_sharded", "diloco+zero",
         "diloco_sharded+zero")
Holding = tuple[tuple[Any, ...], tuple[Any, ...] | None]  # (who holds copies, among whom a stand-in may come)


def holdings_of(kind: str, node: int, local_rank: int) -> dict[str, Holding]:
    """The parts of a state of ``kind`` held by worker (``node``: its launcher name, ``local_rank``), each with who
    holds interchangeable copies (``JOB``: every worker; ``("node", n)``: the workers of node ``n``;
    ``("local", j)``: those of local rank ``j``; ``("node", n, j)``: local rank ``j`` of node ``n``) and, where
    another holder's copy may stand in for a missing one, among whom (a node's own weights may, from the most
    advanced node: ``JOB``; its optimizer's shard ``j`` from that node's worker ``j``: ``("local", j)``; a shard
    every node holds may not: None)."""
    if kind not in KINDS:
        raise ValueError(f"state kind {kind!r} is not one of {', '.join(KINDS)}")
    own, local = (("node", node), JOB), (("local", local_rank), None)
    job = (JOB, None)
    base, zero = kind.removesuffix("+zero"), kind.endswith("+zero")
    if base in ("diloco", "diloco_sharded"):
        optimizer = (("node", node, local_rank), ("local", local_rank)) if zero else own
        return {"run": job, "model": own, "optimizer": optimizer, "node_outer": own,
                "outer": local if base == "diloco_sharded" else job}
    if kind == "sharded_model":  # comm=hsdp: FSDP2 shards the parameters and their optimizer state inside the node
        return {"run": job, "model": local, "optimizer": local}
    return {"run": job, "model": job, "optimizer": local if kind == "node_sharded" else job}


@dataclass(frozen=True)
class Offer:
    """What one worker of the new group holds: its state's kind (None: nothing, a returning node's worker), its
    (node, local rank), and the (step, ...) each part it holds stands at: the further along, the greater."""

    kind: str | None
    node: int
    local_rank: int
    versions: Mapping[str, tuple[int, ...]]


def plan_transfers(offers: Sequence[Offer]) -> tuple[int, list[tuple[str, int, int]]]:
    """The source (the rank whose ``run`` part is furthest along, the lowest among equals) and (part, sender,
    receiver) for every part of the source's state that a rank does not hold as of the source's version, in one
    order on every rank. The source's kind decides the parts; a rank of another kind holds none of them. Raises
    where no rank can send one."""
    runs = [o.versions.get("run") if o.kind is not None else None for o in offers]
    if all(v is None for v in runs):
        raise RuntimeError("recovery in place: no worker of the new membership holds a state to continue from")
    target = max(v for v in runs if v is not None)
    source = runs.index(target)
    kind = offers[source].kind
    assert kind is not None

    def held(o: Offer, name: str) -> bool:
        return o.kind == kind and o.versions.get(name) == target

    transfers = []
    names = [n for n in holdings_of(kind, offers[source].node, offers[source].local_rank) if n in offers[source].versions]
    for name in sorted(names):
        holders = [holdings_of(kind, o.node, o.local_rank)[name] for o in offers]
        for rank, o in enumerate(offers):
            if held(o, name):
                continue
            holder, stand_in = holders[rank]
            senders = [r for r, other in enumerate(offers) if held(other, name) and holders[r][0] == holder]
            if not senders and stand_in is not None:
                senders = [r for r, other in enumerate(offers) if held(other, name) and holders[r][1] == stand_in]
            if not senders:
                raise RuntimeError(f"recovery in place: no live worker holds the {name} of "
                                   f"{'/'.join(map(str, holder))} as of step {target[0]}, which rank {rank} needs (the "
                                   "lost node held the only copy): resume from a checkpoint with cluster.recovery=restart")
            transfers.append((name, senders[0], rank))
    return source, transfers


def _send(obj: Any, dst: int) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst)
    dist.send(data, dst=dst)


def _recv(src: int) -> tuple[Any, int]:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src)
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True), int(size)


def assemble(offer: Offer, parts: dict[str, Any], log: Callable[[str], None]) -> tuple[Offer, dict[str, Any]]:
    """This worker's parts as of the source's version, from itself or its peers (``offer``: what it holds;
    ``parts``: their values, by name). Returns what it holds then (the source's kind and version) and every part
    of it by name. Collective over the new default group."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, offer)
    source, transfers = plan_transfers(everyone)
    kind = everyone[source].kind
    rank = dist.get_rank()
    mine = {name: value for name, value in parts.items() if offer.kind == kind}
    received = []
    for name, sender, receiver in transfers:
        if rank == sender:
            _send(parts[name], receiver)
        elif rank == receiver:
            mine[name], nbytes = _recv(sender)
            received.append((name, sender, nbytes))
    said: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(said, received)
    log(describe_transfers(said, source, everyone[source].versions["run"][0]))
    names = everyone[source].versions
    values = {name: value for name, value in mine.items() if name in names}
    return Offer(kind, offer.node, offer.local_rank, {name: names["run"] for name in values}), values


def describe_transfers(received: Sequence[Sequence[tuple[str, int, int]]], source: int, step: int) -> str:
    """One line: what each rank received from whom, in bytes (or that every rank kept its own state)."""
    lines = []
    for rank, got in enumerate(received):
        if got:
            total = sum(n for _, _, n in got)
            what = ", ".join(f"{name} {human_bytes(n)} from rank {sender}" for name, sender, n in got)
            lines.append(f"rank {rank} <- {what} ({total} bytes)")
    head = f"in place: state as of step {step} (most advanced: rank {source}); "
    return head + ("; ".join(lines) if lines else "every rank kept its own, 0 bytes moved")
