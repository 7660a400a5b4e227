"""Who is still in: the survivors of a failed collective agree on the next membership through a store.

Recovery in place (``cluster.recovery=in_place``) keeps the surviving workers'
processes and rebuilds their process groups. Before they can, they must agree,
without the group that just failed, on who is in. They do it through the
rendezvous store that no training node hosts (:mod:`hybrid.runtime.rdzv_store`),
the way torchft's quorum does through its lighthouse:

- every worker keeps a heartbeat in the store (a counter it adds to every
  :data:`HEARTBEAT_S`, from a thread of its own);
- a worker whose collective failed checks in for the next epoch with the last
  step it completed;
- the membership is decided once every worker of the current epoch has either
  checked in or let its heartbeat stand still for ``dead_after_s``. The first
  worker to see that writes the decision (a compare-and-set, so there is exactly
  one); everyone reads it.

Membership is by whole node, as torch elastic's is: a node is in when all of its
workers of the last epoch are; a worker of a node that lost another of its
workers is left out (it exits, and its agent reports the failure). A worker left
out because its heartbeat came late learns so when it reads the decision.

A node that comes back (:meth:`Quorum.join`) registers its workers as joiners
of the next epoch; the running workers' heartbeat threads see the registration
and make their own collectives fail (:func:`hybrid.runtime.distributed.cut_connections`),
so the next agreement takes the new node in: it is in once all of its workers
have registered.
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from hybrid.core.topology import WorkerEnv
from hybrid.runtime.store_watch import quiet_cpp_warnings

__all__ = ["HEARTBEAT_S", "Heartbeat", "JobEnded", "LeftOut", "MakeRoom", "Member", "Membership", "Quorum"]

HEARTBEAT_S = 0.1


@dataclass(frozen=True)
class Member:
    """One worker, named by its node (hybrid's launcher index, ``HYBRID_NODE``; else the rendezvous rank) and local rank."""

    node: int
    local_rank: int
    step: int = 0  # the last step it completed (when it checked in); -1: a joiner, with no state yet

    @property
    def key(self) -> str:
        return f"{self.node}.{self.local_rank}"


@dataclass(frozen=True)
class Membership:
    """An epoch's workers, in rank order (node, then local rank)."""

    epoch: int
    members: tuple[Member, ...]

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({m.node for m in self.members}))

    def env_of(self, node: int, local_rank: int) -> WorkerEnv:
        """The torchrun environment of worker (``node``, ``local_rank``) in this membership."""
        ranks = [(m.node, m.local_rank) for m in self.members]
        rank = ranks.index((node, local_rank))
        local = [m for m in self.members if m.node == node]
        return WorkerEnv(rank=rank, world_size=len(ranks), local_rank=local_rank, local_world_size=len(local),
                         node=self.nodes.index(node))

    def source(self) -> int:
        """The rank whose state everyone continues from: the lowest of those that completed the most steps."""
        top = max(m.step for m in self.members)
        return next(rank for rank, m in enumerate(self.members) if m.step == top)


class LeftOut(RuntimeError):
    """This worker is not in the membership the survivors decided."""


class MakeRoom(RuntimeError):
    """The next membership is being agreed (a node waits to join, or a peer checked in after a failure): every
    running worker stops after a step, between steps, and meets the others in the agreement."""

    def __init__(self, step: int) -> None:
        super().__init__(f"the next membership is being agreed: stopping after step {step}")
        self.step = step


class JobEnded(RuntimeError):
    """The job this worker came to join has finished: nothing is left to do."""


class Heartbeat:
    """A thread that adds 1 to ``key`` in the store every :data:`HEARTBEAT_S` while this process lives, and
    calls ``on_joiner`` when a node registers to join the epoch after ``epoch()``, until it returns True (it
    acted: once per epoch); and ``on_recovery`` once per epoch when a worker has checked in for the next one
    (``recovery_key``: a counter :meth:`Quorum.check_in` adds to)."""

    def __init__(self, store: Any, key: str, joiners_key: Callable[[], str | None] | None = None,
                 on_joiner: Callable[[], bool] | None = None,
                 on_lost: Callable[[BaseException], Any] | None = None,
                 recovery_key: Callable[[], str | None] | None = None,
                 on_recovery: Callable[[], Any] | None = None) -> None:
        self._store, self._key, self._stop = store, key, threading.Event()
        self._on_lost = on_lost
        self._joiners_key, self._on_joiner = joiners_key, on_joiner
        self._recovery_key, self._on_recovery = recovery_key, on_recovery
        self._thread = threading.Thread(target=self._beat, name="hybrid-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        told = recovering = None
        while not self._stop.is_set():
            try:
                with quiet_cpp_warnings():  # a store that dies mid-call: one line below, not a C++ stack
                    self._store.add(self._key, 1)
                    key = self._joiners_key() if self._joiners_key is not None else None
                    waiting = key is not None and key != told and self._store.add(key, 0) > 0
                    checked = self._recovery_key() if self._recovery_key is not None else None
                    if checked is not None and checked != recovering and self._store.add(checked, 0) > 0:
                        recovering = checked
                        self._on_recovery()
                if waiting and self._on_joiner():
                    told = key
            except Exception as exc:  # noqa: BLE001 - the store is gone: nothing left to tell
                if self._on_lost is not None:
                    self._on_lost(exc)
                else:
                    said = str(exc).splitlines()[0][:160] if str(exc) else ""
                    print(f"worker {self._key.rsplit('/', 1)[-1]}: lost the rendezvous store ({type(exc).__name__}: "
                          f"{said}); its heartbeat stopped", file=sys.stderr, flush=True)
                return
            self._stop.wait(HEARTBEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)


class Quorum:
    """The survivors' agreement on the next membership, under ``prefix`` in ``store``.

    ``dead_after_s``: how long a worker's heartbeat may stand still before it counts as gone;
    ``timeout_s``: the longest an agreement may take (a worker of the last epoch that neither checks in nor
    dies in that time is taken as gone too: it is stuck)."""

    def __init__(self, store: Any, prefix: str, dead_after_s: float, timeout_s: float) -> None:
        self.store, self.prefix = store, prefix
        self.dead_after_s, self.timeout_s = dead_after_s, timeout_s

    def heartbeat(self, me: Member, store: Any, epoch: Callable[[], int | None] | None = None,
                  on_joiner: Callable[[], bool] | None = None,
                  on_lost: Callable[[BaseException], Any] | None = None,
                  on_recovery: Callable[[], Any] | None = None) -> Heartbeat:
        """Start this worker's heartbeat (on ``store``: a client of its own, so a blocking wait on the other
        never delays it); ``on_joiner`` is called when a node registers for the epoch after ``epoch()``,
        ``on_recovery`` when a worker has checked in for it, ``on_lost`` with the error when the store stops
        answering (the heartbeat then stops)."""
        def next_key(name: str) -> Callable[[], str | None]:
            def key() -> str | None:
                current = epoch() if epoch is not None else None
                return None if current is None else f"{self.prefix}/epoch{current + 1}/{name}"
            return key

        return Heartbeat(store, f"{self.prefix}/hb/{me.key}", next_key("joiners"), on_joiner, on_lost,
                         next_key("checked_in") if on_recovery is not None else None, on_recovery)

    def publish(self, membership: Membership) -> None:
        """Record ``membership`` as decided (the first one, which the rendezvous made), for joiners to find."""
        base = f"{self.prefix}/epoch{membership.epoch}"
        self.store.compare_set(f"{base}/decision", "", pickle.dumps(membership))
        self.store.set(f"{self.prefix}/epoch", str(membership.epoch))

    def decided(self, epoch: int) -> Membership:
        """The membership decided for ``epoch``."""
        return pickle.loads(self.store.get(f"{self.prefix}/epoch{epoch}/decision"))

    def current_epoch(self) -> int | None:
        """The last decided epoch (None: nothing decided under this prefix)."""
        key = f"{self.prefix}/epoch"
        return int(self.store.get(key)) if self.store.check([key]) else None

    def join(self, me: Member, node_size: int, timeout_s: float | None = None, ended_key: str | None = None
             ) -> Membership:
        """Register this worker of a node of ``node_size`` workers to join the next epoch; return the
        membership that takes it in (registering again for the one after where a decision came first), or
        raise ``TimeoutError`` after ``timeout_s`` (default: the agreement's), :class:`JobEnded` once
        ``ended_key`` is set (the job finished while this worker waited)."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while time.monotonic() < deadline:
            epoch = (self.current_epoch() or 0) + 1
            base = f"{self.prefix}/epoch{epoch}"
            self.store.set(f"{base}/in/{me.key}", pickle.dumps((-1, os.getpid())))
            index = self.store.add(f"{base}/joiners", 1) - 1
            self.store.set(f"{base}/joiner/{index}", pickle.dumps((me.node, me.local_rank, node_size)))
            # Looked at every beat rather than waited on: a store wait that times out prints a C++ warning, and
            # the job's end (ended_key) must stop the wait too.
            while not self.store.check([f"{base}/decision"]):
                if ended_key is not None and self.store.check([ended_key]):
                    raise JobEnded(f"worker {me.key}: the job finished before it could join")
                if time.monotonic() > deadline:
                    break
                time.sleep(HEARTBEAT_S)
            else:
                membership = pickle.loads(self.store.get(f"{base}/decision"))
                if (me.node, me.local_rank) in [(m.node, m.local_rank) for m in membership.members]:
                    return membership
        raise TimeoutError(f"worker {me.key} found no membership to join within {timeout_s or self.timeout_s:g} s")

    def check_in(self, current: Membership, me: Member) -> None:
        """Say that this worker is in for the epoch after ``current``, with ``me.step``. A worker checked in
        counts as alive whatever its heartbeat does: a worker that checks in as soon as its collective fails,
        before the slow part of its recovery (letting go of its groups, which can hold the GIL for a while on a
        busy machine), cannot be taken as gone meanwhile. :meth:`agree` checks in too."""
        base = f"{self.prefix}/epoch{current.epoch + 1}"
        self.store.set(f"{base}/in/{me.key}", pickle.dumps((me.step, os.getpid())))
        self.store.add(f"{base}/checked_in", 1)  # the running workers' heartbeats see a recovery begin

    def agree(self, current: Membership, me: Member) -> Membership:
        """Check in for the epoch after ``current`` with ``me.step``; return the decided membership, or raise
        :class:`LeftOut` where this worker is not in it, ``TimeoutError`` where no decision came in time."""
        epoch = current.epoch + 1
        base = f"{self.prefix}/epoch{epoch}"
        self.check_in(current, me)
        decided = self._decide(current, base, time.monotonic() + self.timeout_s)
        membership = pickle.loads(decided)
        if (me.node, me.local_rank) not in [(m.node, m.local_rank) for m in membership.members]:
            raise LeftOut(f"worker {me.key} is not in epoch {epoch}'s membership "
                          f"(nodes {list(membership.nodes)}): its node lost a worker, or it checked in late")
        return membership

    def _decide(self, current: Membership, base: str, deadline: float) -> bytes:
        """Wait until every worker of ``current`` has checked in or gone; write the decision unless someone has."""
        beats: dict[str, tuple[int, float]] = {}
        while True:
            if self.store.check([f"{base}/decision"]):
                return self.store.get(f"{base}/decision")
            now = time.monotonic()
            checked: dict[str, int] = {}
            pending = []
            for m in current.members:
                if self.store.check([f"{base}/in/{m.key}"]):
                    checked[m.key] = pickle.loads(self.store.get(f"{base}/in/{m.key}"))[0]
                    continue
                count = self.store.add(f"{self.prefix}/hb/{m.key}", 0)
                last = beats.get(m.key)
                if last is None or count != last[0]:
                    beats[m.key] = (count, now)
                if now - beats[m.key][1] < self.dead_after_s and now < deadline:
                    pending.append(m.key)
            if not pending:
                decision = pickle.dumps(self._membership(current, checked, self._joiners(base)))
                # Only the first writer's decision stands: compare_set writes where the key is still absent.
                stands = self.store.compare_set(f"{base}/decision", "", decision)
                if stands == decision:
                    self.store.set(f"{self.prefix}/epoch", str(current.epoch + 1))
                return stands
            time.sleep(HEARTBEAT_S / 2)

    def _joiners(self, base: str) -> list[Member]:
        """The workers of nodes that registered to join at ``base``'s epoch, whole nodes only."""
        count = self.store.add(f"{base}/joiners", 0)
        found = [pickle.loads(self.store.get(f"{base}/joiner/{i}")) for i in range(count)]
        sizes = {node: size for node, _, size in found}
        locals_of: dict[int, set[int]] = {}
        for node, local, _ in found:
            locals_of.setdefault(node, set()).add(local)
        return [Member(node, local, -1) for node in sorted(sizes) if len(locals_of[node]) == sizes[node]
                for local in sorted(locals_of[node])]

    @staticmethod
    def _membership(current: Membership, checked: dict[str, int], joiners: list[Member] = ()) -> Membership:
        """Whole nodes whose every worker checked in, each member with the step it reported, then the nodes
        that join (not already members)."""
        whole = [node for node in current.nodes
                 if all(m.key in checked for m in current.members if m.node == node)]
        kept = [Member(m.node, m.local_rank, checked[m.key]) for m in current.members if m.node in whole]
        new = [j for j in joiners if j.node not in current.nodes]
        return Membership(current.epoch + 1, tuple(kept + new))
