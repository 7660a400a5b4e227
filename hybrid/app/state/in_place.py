"""Recovery in place (``cluster.recovery=in_place``): survive a lost node without restarting any process.

With restarts (the default), a worker whose collective fails exits, every agent
restarts its workers on the smaller membership, and the job resumes from its
last checkpoint. In place, the workers of the surviving nodes keep their
processes:

1. a worker whose collective fails (a peer died, its link went down) takes its
   state as of the last step it completed (:mod:`hybrid.app.state.in_memory`), and
   destroys every process group it holds, so the peers still blocked on it fail
   at once instead of at their timeout;
2. the survivors agree on the new membership through the store that no training
   node hosts (:mod:`hybrid.runtime.quorum`);
3. they build a new default group there and run the job's set-up again, which
   rebuilds every other group (intra, leaders, cross, DDP's), with the state of
   the survivor that completed the most steps sent to all over the new group,
   as a checkpoint would be read from disk: the membership history, the LR
   policy (``trainer.elastic_lr``) and the data position change exactly as
   with a restart; at most the step in flight is lost.

A worker's torchrun environment (``RANK``, ``WORLD_SIZE``, ``GROUP_RANK`` ...)
follows its place in the new membership. The store's address reaches the workers
as ``HYBRID_RDZV_ENDPOINT`` (hybrid's launcher sets it for elastic jobs); under
torchrun, from ``cluster.rdzv_endpoint`` (torchrun's ``--rdzv-endpoint``: a store off
the nodes), and the finishing workers count a lost node's torchrun agent in at
torch's exit barrier (:mod:`hybrid.runtime.exit_barrier`).
"""

from __future__ import annotations

import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid.app.config import TrainConfig
from hybrid.app.state.in_memory import HeldState, checkpoint_meta
from hybrid.app.state.peer_state import Offer
from hybrid.core.comm.ordered_stream import OrderedStream, drop_tracebacks
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer
from hybrid.core.topology import Topology, WorkerEnv
from hybrid.runtime.agent import attempt_prefix, nodes_at_end_key
from hybrid.runtime.distributed import cut_connections, socket_inodes
from hybrid.runtime.etcd_store import ETCD_SCHEME, connect_store, members_of
from hybrid.runtime.exit_barrier import count_in_lost_agents
from hybrid.runtime.heap import trim_heap
from hybrid.runtime.launch import is_consequence
from hybrid.runtime.quorum import HEARTBEAT_S, MakeRoom, Member, Membership, Quorum
from hybrid.runtime.rdzv_store import NODE_ENV, STORE_ENV
from hybrid.runtime.store_watch import StoreWatch

__all__ = ["DEAD_AFTER_S", "STORE_ENV", "InPlace", "attempt_prefix", "nodes_at_end_key"]

# A worker whose heartbeat (every 0.1 s) stands still this long counts as gone: long enough for a process
# sharing a busy machine's cores, short enough to keep a recovery within a few seconds.
DEAD_AFTER_S = 1.0
# How far ahead, in time, the running workers agree to stop for a joining node: every worker's heartbeat must
# learn the step before its training passes it (a beat is 0.1 s; a busy machine delays beats several-fold).
ROOM_LEAD_S = 1.0


class InPlace:
    """This worker's side of recovery in place: the store, its heartbeat, the membership, and what the
    current attempt of the training continues from."""

    def __init__(self, cfg: TrainConfig) -> None:
        # hybrid's agents export the store; under torchrun it is cluster.rdzv_endpoint (torchrun's --rdzv-endpoint).
        endpoint = os.environ.get(STORE_ENV, "") or _configured_store(cfg)
        try:
            self.endpoint = members_of(endpoint)  # the store, or every member of an etcd cluster
        except ValueError:
            raise RuntimeError(f"cluster.recovery=in_place needs a rendezvous store that no training node hosts, "
                               f"named by {STORE_ENV}=HOST:PORT or etcd://HOST:PORT,... (hybrid's launcher sets it "
                               f"for elastic jobs: cluster.min_nnodes < cluster.nnodes; under torchrun, give "
                               f"cluster.rdzv_endpoint=HOST:PORT, torchrun's --rdzv-endpoint); got {endpoint!r}") from None
        timeout = timedelta(seconds=cfg.comm.timeout_s)
        self.store = connect_store(endpoint, timeout)
        self.prefix = attempt_prefix(os.environ.get("TORCHELASTIC_RUN_ID", "none"), os.environ.get("MASTER_ADDR", ""),
                                     os.environ.get("MASTER_PORT", ""))
        run_id = self.run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        self.live_key = f"hybrid/in_place/{run_id}/live"
        # Set once the job's workers finish: a node that comes back later has nothing to join (and must not
        # start a training of its own in the job's run directory).
        self.ended_key = nodes_at_end_key(run_id)
        self.over = self.store.check([self.ended_key])
        # A node that comes back starts in a rendezvous round of its own: where the job's workers are still
        # training under another attempt's keys, this one joins them rather than starting a membership.
        live = self.store.get(self.live_key).decode() if self.store.check([self.live_key]) else None
        self.joining = live is not None and live != self.prefix and _beating(self.store, live)
        if self.joining:
            self.prefix = live
        self.quorum = Quorum(self.store, self.prefix, DEAD_AFTER_S, cfg.comm.timeout_s)
        self.env = WorkerEnv.from_env()
        # A node is named by hybrid's launcher (HYBRID_NODE, the same when its agent starts again), else by its
        # rendezvous rank.
        self.me = Member(int(os.environ.get(NODE_ENV, self.env.node)), self.env.local_rank)
        self.membership: Membership | None = None
        # The heartbeat's own client: a blocking wait on the other never holds it up. When a node registers
        # to join, it makes this worker's collectives fail, so that the next agreement takes the node in.
        # Where the store goes, this worker says so in one line (its agent stops it), not in C++ stack traces.
        self.store_watch = StoreWatch(f"worker {self.me.key}", endpoint, "its agent stops it")
        self._room_after: int | None = None  # the agreed step to stop after for a joining node
        self._joiner_since: float | None = None
        self._heart_store = connect_store(endpoint, timeout)  # the heartbeat thread's own client
        self._heart = self.quorum.heartbeat(
            self.me, self._heart_store,
            epoch=lambda: self.membership.epoch if self.membership is not None else None,
            on_joiner=self._make_room, on_lost=self.store_watch.lost, on_recovery=self._stop_for_recovery)
        self.cfg = cfg
        self.run: Any = None  # the set-up's Training (hybrid.app.setup), which this sub-package cannot import
        self.run_path: Path | None = None
        self.held: HeldState | None = None
        self._session_start: int | None = None  # the step this session's training started at
        self._spare = socket_inodes()  # the agent's (shared by a forked worker) and the store's: never cut

    def group_store(self) -> Any:
        """Where the current membership's default group meets."""
        epoch = self.membership.epoch if self.membership is not None else 0
        return dist.PrefixStore(f"{self.prefix}/group{epoch}", self.store)

    def begin(self, topology: Topology, run_path: Path) -> None:
        """The first membership, once the default group exists: every rank's (node, local rank), in rank
        order; rank 0 publishes it for nodes that join later. Collective the first time."""
        self.run_path = run_path
        if self.membership is None:
            names: list[Any] = [None] * topology.world_size
            dist.all_gather_object(names, (self.me.node, self.me.local_rank))
            self.membership = Membership(0, tuple(Member(node, local) for node, local in names))
            if topology.rank == 0:
                self.quorum.publish(self.membership)
                self.store.set(self.live_key, self.prefix)

    def join(self) -> WorkerEnv:
        """This worker of a node that comes back: register, wait for the membership that takes the node in,
        and take its place there; the state comes from a running worker at the set-up (:class:`HeldState`)."""
        started = time.monotonic()
        # Twice the collective timeout: a running worker whose collective was in flight when the join began
        # can wait out its timeout before it meets the others (seen in about one join in eight here).
        new = self.quorum.join(self.me, self.env.local_world_size, 2 * self.cfg.comm.timeout_s + 10, self.ended_key)
        old = self.quorum.decided(new.epoch - 1)
        self.membership = new
        env = new.env_of(self.me.node, self.me.local_rank)
        _export(env, len(new.nodes))
        self.held = HeldState(Offer(None, self.me.node, self.me.local_rank, {}), {}, change_of(old, new))
        print(f"worker {self.me.key}: joined in place as rank {env.rank} of {env.world_size} on {len(new.nodes)} "
              f"node(s) ({time.monotonic() - started:.2f} s)", file=sys.stderr, flush=True)
        self.env = env
        return env

    def watch(self, run: Any) -> None:
        """The training this worker continues from if a collective fails (its progress, kept by the loop), and
        which asks, at each step's end, whether to stop for a joining node (:meth:`_make_room`)."""
        self._room_after, self._joiner_since = None, None
        self.run = run
        self._session_start = run.start_step if run is not None else None
        if run is not None:
            run.room_after = lambda: self._room_after

    def _make_room(self) -> bool:
        """A node waits to join (called by the heartbeat thread at every beat while it does): agree on a step
        every running worker stops after, so that they meet the joiner in the next agreement.

        The first worker to see the joiner proposes its last completed step plus a lead of about
        :data:`ROOM_LEAD_S` worth of steps (a compare-and-set: one proposal stands); every worker's training
        loop stops after that step (:class:`MakeRoom`), between steps, where no collective is in flight. Cutting
        a worker's connections mid-collective instead left, in about one join in thirty here, a worker blocked
        in a gloo receive that no cut wakes, for its whole collective timeout. Only where a worker is already
        past the agreed step when it learns it (or the agreement has not happened within a few leads) are its
        connections cut, as a lost peer's would be, so that it fails now rather than at its timeout.

        Only once this session has completed a step (every group built, on every rank)."""
        run, start = self.run, self._session_start
        if run is None or start is None or run.progress.step <= start or self.membership is None:
            return False
        now, done = time.monotonic(), run.progress.step
        if self._joiner_since is None:
            self._joiner_since = now
        if self._room_after is None:
            lead = max(2, min(1000, math.ceil(ROOM_LEAD_S / max(run.progress.step_s, 1e-3))))
            key = f"{self.prefix}/epoch{self.membership.epoch + 1}/room_after"
            self._room_after = int(self._heart_store.compare_set(key, "", str(done + lead)))
        if done > self._room_after or now - self._joiner_since > 3 * ROOM_LEAD_S + 2:
            cut_connections(self.endpoint, self._spare)
        return False

    def _stop_for_recovery(self) -> None:
        """A worker checked in for the next membership (its collective failed): stop after the step in progress,
        between steps, and meet it there. In the every-step modes this worker's own collectives fail at once
        anyway; a DiLoCo node between its syncs has none to fail, and would otherwise train on alone until its
        next exchange while the others wait for it."""
        run = self.run
        if run is not None and self._room_after is None:
            self._room_after = run.progress.step

    def recoverable(self, exc: BaseException) -> bool:
        """A failure a peer caused (closed connections, a timed-out collective), or the agreed stop for a joining
        node, after the first membership."""
        return self.membership is not None and (isinstance(exc, MakeRoom)
                                                or is_consequence(f"{type(exc).__name__}: {exc}"))

    def recover(self, exc: BaseException) -> WorkerEnv:
        """Leave every group, agree on who is in, and return this worker's place in the new membership (also
        in its torchrun environment). Raises :class:`hybrid.runtime.quorum.LeftOut` where it is not in."""
        started = time.monotonic()
        self._session_start = None  # not training: a joiner waits for the next session's first step
        old = self.membership
        assert old is not None
        step = self.run.progress.step if self.run is not None else -1
        member = Member(self.me.node, self.me.local_rank, step)
        # In first: what follows can keep this worker's heartbeat still for a second on a busy machine (a
        # survivor taken as gone for that would lose its node, seen under load).
        self.quorum.check_in(old, member)
        cause = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        cut_connections(self.endpoint, self._spare)  # every collective still pending here, and on peers, fails now
        _forget_frames(exc)
        offer, parts = self._parts()
        _leave_groups()
        new = self.quorum.agree(old, member)
        if len(new.nodes) < self.cfg.cluster.min_nnodes:  # as torch's rendezvous refuses a round below its minimum
            raise RuntimeError(f"recovery in place: {len(new.nodes)} node(s) left ({list(new.nodes)}), fewer than "
                               f"cluster.min_nnodes={self.cfg.cluster.min_nnodes}: the job stops ({cause})")
        self.membership = new
        env = new.env_of(self.me.node, self.me.local_rank)
        _export(env, len(new.nodes))
        self.held = HeldState(offer, parts, change_of(old, new))
        print(f"worker {self.me.key}: {cause}; recovering in place: "
              f"rank {env.rank} of {env.world_size} on {len(new.nodes)} node(s), continuing from step "
              f"{new.members[new.source()].step} ({time.monotonic() - started:.2f} s)", file=sys.stderr, flush=True)
        self.env = env
        return env

    def finished(self) -> None:
        """Say how many nodes finished, for the agents' exit barrier (lost nodes' agents never arrive there):
        hybrid's agents read it; under plain torchrun rank 0 counts the lost agents in at torch's own barrier."""
        if self.membership is None:
            return
        nodes = len(self.membership.nodes)
        self.store.set(self.ended_key, str(nodes))
        if NODE_ENV not in os.environ and self.env.rank == 0:  # no hybrid agent: torchrun's
            try:
                lost = count_in_lost_agents(self.store, self.run_id, nodes)
            except Exception as exc:  # noqa: BLE001 - torch's rendezvous state unreadable: its agents wait 300 s
                print(f"worker {self.me.key}: could not count lost nodes' agents in at torchrun's exit barrier "
                      f"({type(exc).__name__}: {exc}): the others' agents wait up to 300 s", file=sys.stderr, flush=True)
                return
            if lost:
                print(f"worker {self.me.key}: {lost} lost node(s)' agents counted in at torchrun's exit barrier",
                      file=sys.stderr, flush=True)

    def close(self) -> None:
        self._heart.stop()
        self.store_watch.stop()

    def _parts(self) -> tuple[Offer, dict[str, Any]]:
        """This worker's state as of its last completed step, by part (:mod:`hybrid.app.state.peer_state`), and
        the (step, ...) each stands at. A node-sharded optimizer's shard may stand a step further (its update
        taken, the node's gather of the parameters not); a DiLoCo rank may stand inside a step (its inner step
        taken, some of its outer step's operations not: :attr:`hybrid.core.diloco.OuterSync.version`); under
        comm=adaptive, the switches it has committed count before the stage."""
        run = self.run
        if run is None:  # no run this session: what it was to continue from, if anything
            return (self.held.offer, self.held.parts) if self.held is not None else (
                Offer(None, self.me.node, self.me.local_rank, {}), {})
        progress, layout, access = run.progress, run.layout, run.state
        outer = getattr(access, "outer", None)  # DiLoCo's OuterSync (comm=diloco; comm=adaptive in DiLoCo)
        step, stage = outer.version if outer is not None else (progress.step, 0)
        switches = getattr(access, "switches_done", None)  # comm=adaptive
        version = (step, stage) if switches is None else (step, switches, stage)
        data = run.streams[0].state() if step > progress.step else dict(progress.data)  # inner step done: its batches too
        held = getattr(access, "held_entries", dict)()  # comm=adaptive's mode and switches
        parts: dict[str, Any] = {
            "run": {"scheduler": run.scheduler.state_dict(), "step": step, "data": data, "rng": torch.get_rng_state(),
                    "membership": list(run.membership), **held,
                    **checkpoint_meta(self.cfg.model.node, layout.world_size, layout.nnodes, layout.global_batch,
                                      access.kind, self.cfg.optim.no_decay)},
            "model": run.model.state_dict()}
        versions = {"run": version, "model": version, "optimizer": version}
        optimizer = run.optimizer
        held_shards = getattr(access, "held", None)  # comm=hsdp: this rank's FSDP2 shards
        if held_shards is not None:
            parts["model"], parts["optimizer"] = held_shards(run.model, optimizer)
            kind = "sharded_model"
        elif isinstance(optimizer, NodeShardedOptimizer):
            parts["optimizer"] = optimizer.shard_state()
            shard_step = progress.step + optimizer.updates - progress.optimizer_updates
            # As of the stage (DiLoCo's inner step done, its outer step not) where it took that step's update.
            versions["optimizer"] = version if shard_step == step else (shard_step, 0)
            kind = "node_sharded"
        else:
            parts["optimizer"] = optimizer.state_dict()
            kind = "replicated"
        if getattr(access, "in_diloco", outer is not None):
            kind = ("diloco_sharded" if outer is not None and outer.inter == "sharded" else "diloco") + (
                "+zero" if kind == "node_sharded" else "")
        if outer is not None:
            parts["outer"], parts["node_outer"] = outer.held_state()
            versions["outer"] = versions["node_outer"] = version
        return Offer(kind, self.me.node, self.me.local_rank, versions), parts


def _configured_store(cfg: TrainConfig) -> str:
    """The control plane's store as the config names it (``cluster.rdzv_endpoint``), in the workers' form."""
    endpoint = cfg.cluster.rdzv_endpoint
    return ETCD_SCHEME + endpoint if endpoint and cfg.cluster.rdzv_backend == "etcd" else endpoint


def change_of(old: Membership, new: Membership) -> str:
    """The membership history's words for a change in place."""
    lost = sorted(set(old.nodes) - set(new.nodes))
    joined = sorted(set(new.nodes) - set(old.nodes))
    said = [f"node(s) {lost} lost"] if lost else []
    said += [f"node(s) {joined} joined"] if joined else []
    return "in place: " + (", ".join(said) if said else "a collective failed, every node still in")


def _beating(store: Any, prefix: str, within_s: float = 2 * DEAD_AFTER_S) -> bool:
    """Whether any worker of the last membership decided under ``prefix`` is alive: its heartbeat moves within
    ``within_s`` (twice the time after which the quorum counts a worker as gone: a busy machine delays beats)."""
    quorum = Quorum(store, prefix, DEAD_AFTER_S, within_s)
    epoch = quorum.current_epoch()
    if epoch is None:
        return False
    keys = [f"{prefix}/hb/{m.key}" for m in quorum.decided(epoch).members]
    first = [store.add(k, 0) for k in keys]
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        time.sleep(HEARTBEAT_S)
        if any(store.add(k, 0) != n for k, n in zip(keys, first)):
            return True
    return False


def _forget_frames(exc: BaseException | None) -> None:
    """Drop the failed session's frames, which the exception (and those it chains) keep alive with their
    locals: DDP, the communicator and its groups. A gloo group's connections close only when the last
    reference to it goes (neither abort nor destroy closes them), and until they close a peer blocked on
    one of them waits for its timeout."""
    drop_tracebacks(exc)


def _leave_groups() -> None:
    """Abort, destroy and let go of every process group this process holds: their connections close at once,
    so a peer blocked on one of them fails now rather than at its timeout."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    OrderedStream.forget_failures()  # a failed job's traceback, held by its Future from C++, keeps the groups
    if not dist.is_initialized():
        gc.collect()
        return

    for group in list(c10d._world.pg_names):  # every group, the default one included
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - already broken: destroying it below is what matters
            pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        c10d._world.pg_map.clear()
        c10d._update_default_pg(None)
    gc.collect()  # DDP and the communicator hold their groups in reference cycles
    trim_heap()


def _export(env: WorkerEnv, nnodes: int) -> None:
    """This worker's torchrun environment in the new membership."""
    os.environ.update({"RANK": str(env.rank), "WORLD_SIZE": str(env.world_size), "GROUP_RANK": str(env.node),
                       "LOCAL_WORLD_SIZE": str(env.local_world_size), "GROUP_WORLD_SIZE": str(nnodes),
                       "ROLE_RANK": str(env.rank), "ROLE_WORLD_SIZE": str(env.world_size)})
