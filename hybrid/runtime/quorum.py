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
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any

from hybrid.core.topology import WorkerEnv

__all__ = ["HEARTBEAT_S", "Heartbeat", "LeftOut", "Member", "Membership", "Quorum"]

HEARTBEAT_S = 0.1


@dataclass(frozen=True)
class Member:
    """One worker, named by where it started: its node (the agent's ``GROUP_RANK``) and local rank."""

    node: int
    local_rank: int
    step: int = 0  # the last step it completed (when it checked in)

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


class Heartbeat:
    """A thread that adds 1 to ``key`` in the store every :data:`HEARTBEAT_S` while this process lives."""

    def __init__(self, store: Any, key: str) -> None:
        self._store, self._key, self._stop = store, key, threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hybrid-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except Exception:  # noqa: BLE001 - the store is gone: nothing left to tell
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

    def heartbeat(self, me: Member, store: Any) -> Heartbeat:
        """Start this worker's heartbeat (on ``store``: a client of its own, so a blocking wait on the other
        never delays it)."""
        return Heartbeat(store, f"{self.prefix}/hb/{me.key}")

    def agree(self, current: Membership, me: Member) -> Membership:
        """Check in for the epoch after ``current`` with ``me.step``; return the decided membership, or raise
        :class:`LeftOut` where this worker is not in it, ``TimeoutError`` where no decision came in time."""
        epoch = current.epoch + 1
        base = f"{self.prefix}/epoch{epoch}"
        self.store.set(f"{base}/in/{me.key}", pickle.dumps((me.step, os.getpid())))
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
                decision = pickle.dumps(self._membership(current, checked))
                # Only the first writer's decision stands: compare_set writes where the key is still absent.
                return self.store.compare_set(f"{base}/decision", "", decision)
            time.sleep(HEARTBEAT_S / 2)

    @staticmethod
    def _membership(current: Membership, checked: dict[str, int]) -> Membership:
        """Whole nodes whose every worker checked in, each member with the step it reported."""
        whole = [node for node in current.nodes
                 if all(m.key in checked for m in current.members if m.node == node)]
        return Membership(current.epoch + 1, tuple(
            Member(m.node, m.local_rank, checked[m.key]) for m in current.members if m.node in whole))
