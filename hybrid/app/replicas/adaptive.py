"""comm=adaptive in the trainer: every-step hierarchical or sharded while the inter-node link is fast (with the
16-bit inter-node hop where comm.adapt_modes offers it), DiLoCo while it is slow, switching at the same step on
every rank.

What decides: :class:`hybrid.app.observability.link_watch.LinkWatch` (every ``comm.adapt_every`` steps, one
estimate from all-reduced counters, so every rank reaches the same advice at the same step), or a plan of
switches at given steps (``comm.adapt_plan``). A switch happens between two steps, where no collective is in
flight, and rebuilds torch DDP for the new mode: over the whole job with hybrid's comm hook (every-step
modes), or over the node's own group with the nodes meeting every H steps (DiLoCo).

- **Entering DiLoCo** starts its global copy from the current weights (every rank holds the same ones) and
  its outer optimizer from the state it had when the previous DiLoCo phase ended (momentum survives a round
  trip; the first phase starts it at zero). H is ``comm.sync_every``, or, at 0, the interval the measured
  link carries (the advice's).
- **Leaving DiLoCo** syncs whatever moved since the last sync (``OuterSync.finish``: every rank then holds
  the same weights) and averages the inner optimizer's state over every rank (each node's had drifted), so the
  replicas are bit-identical again, and every-step training keeps them so.

- **A 16-bit mode** (``hierarchical+bf16``, ``sharded+bf16``) keeps one compressor, with its error-feedback
  residuals and its guard, from the run's start to its end: a phase of the mode goes on from the residuals the
  last one left, and every checkpoint carries them (``error_feedback``), in whatever mode it is written.

Checkpoints hold the running mode, the kept outer optimizer state and the link watch's state (``adaptive``),
and, inside a DiLoCo phase, DiLoCo's own entries (:class:`hybrid.app.replicas.diloco.DilocoState`): a run
resumed anywhere, in any mode, continues as the straight run does, given the same decisions.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.app.components.losses import batch_loss
from hybrid.app.config import DILOCO, IN_PLACE, TrainConfig
from hybrid.app.replicas import diloco
from hybrid.app.replicas.base import PlainState, RankReplica
from hybrid.app.state.in_memory import HELD_OUTER_KEY
from hybrid.core.adaptive import Mode, ModePlan
from hybrid.core.comm import CommGroups, InterCompressor, NodeCommunicator, PhaseCounters, make_communicator, register_comm_hook, settle_buckets
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer
from hybrid.core.topology import Topology

__all__ = ["CHECKPOINT_KEY", "GROUP_KINDS", "AdaptiveReplica", "AdaptiveState", "adaptive_modes", "streamable",
           "average_optimizer_state"]

CHECKPOINT_KEY = "adaptive"
GROUP_KINDS = ("intra", "leaders", "cross")  # every mode's groups, built once: a switch builds none
DEFAULT_SYNC_EVERY = 32  # DiLoCo's H where comm.sync_every=0 and no estimate has priced one yet
# The probe of the idle link under DiLoCo: 128 KiB take 52 ms at 20 Mbit/s, 2 ms at 500 Mbit/s (timed after as many
# bytes that spend the link's burst allowance: 78 ms in all at 20 Mbit/s on the testbed).
PROBE_BYTES = 128 * 1024


def adaptive_modes(cfg: TrainConfig) -> tuple[Mode, ...]:
    """comm.adapt_modes as modes, most faithful first (DiLoCo at comm.sync_every; 0: priced by the link)."""
    return tuple(Mode.parse(m, cfg.comm.sync_every or DEFAULT_SYNC_EVERY) for m in cfg.comm.adapt_modes)


def streamable(every: int, fragments: int, overlap_steps: int) -> int:
    """The measured interval ``every``, rounded up to the nearest one a streamed DiLoCo can run: a multiple of
    ``fragments`` (each syncs once per interval, at its own step) with ``overlap_steps`` inner steps for each
    fragment's exchange to land before the next leaves."""
    every = max(every, fragments * overlap_steps)
    return -(-every // fragments) * fragments


class AdaptiveReplica:
    """This rank's model under the running mode's DDP (:class:`RankReplica` or :class:`diloco.DilocoReplica`),
    switched between steps. ``wrap(model, group)`` builds DDP with the run's options; ``sample`` is a batch for
    settling a new DDP's buckets. ``watch``: the link watch whose advice it follows (a
    :class:`hybrid.app.observability.link_watch.LinkWatch`; None with comm.adapt_every=0), told of each switch;
    its ``probe`` should be :meth:`probe`. ``log_scalars(step, values)`` and ``status(line)``: the run's
    TensorBoard metrics and status lines."""

    def __init__(self, cfg: TrainConfig, topology: Topology, groups: CommGroups, counters: PhaseCounters,
                 run: Any, device: torch.device, wrap: Callable[[nn.Module, Any], DDP], sample: tuple[Any, Any],
                 watch: Any, log_scalars: Callable[[int, dict[str, float]], None],
                 status: Callable[[str], None]) -> None:
        self.cfg, self.topology, self.groups, self.counters = cfg, topology, groups, counters
        self.run, self.device, self.wrap, self.sample, self.watch = run, device, wrap, sample, watch
        self.log_scalars, self.status = log_scalars, status
        self.plan: ModePlan | None = cfg.comm.plan()
        self.modes = adaptive_modes(cfg)
        self.done = run.start_step
        self.switches: list[dict[str, Any]] = []
        self._kept: dict[str, Any] | None = None  # the outer optimizer's state when the last DiLoCo phase ended
        # The 16-bit modes' compressors (error-feedback residuals, the guard's place), one per mode, kept through
        # every switch: a mode entered again goes on from its residuals, and checkpoints carry them all.
        self._compressors = {mode.name: cfg.comm.guarded(InterCompressor(mode.inter_compression))
                             for mode in self.modes if mode.inter_compression != "none"}
        self._inner: RankReplica | None = None
        self._hook: Any = None
        self.outer: Any = None
        # comm.shard_optimizer: the optimizer's shards follow every DDP the switches build (each mode's communicator
        # in the every-step modes; in DiLoCo, the node's own, over a node group of its own as comm=diloco has it).
        self._node_groups: CommGroups | None = None
        if cfg.comm.shard_optimizer:
            if not topology.is_uniform:
                raise ValueError(f"comm=adaptive with comm.shard_optimizer=true needs nodes of equal size, these have "
                                 f"{list(topology.node_sizes)} workers: leaving DiLoCo averages each worker's shard "
                                 "of the inner optimizer with the same local rank's on every node")
            self._node_groups = CommGroups.build(topology, cfg.comm.intra_backend, cfg.comm.inter_backend,
                                                 cfg.comm.timeout_s, kinds=("intra",))
        saved = run.resumed_extra.get(CHECKPOINT_KEY)
        self.mode = self.modes[0]
        if saved is not None:
            self.mode = Mode.parse(saved["mode"], saved["sync_every"])
            self._kept, self.switches = saved["kept"], list(saved["switches"])
            if self.watch is not None and saved["watch"] is not None:
                self.watch.load_state_dict(saved["watch"])
        # Recovery in place: DiLoCo's outer state held in memory (its interrupted step finished first), or none where
        # the phase had just been entered (it starts again from the weights, as the switch does).
        self._in_place = cfg.cluster.recovery == IN_PLACE
        extra = run.resumed_extra
        resumed = extra[HELD_OUTER_KEY] if HELD_OUTER_KEY in extra else extra.get(diloco.CHECKPOINT_KEY)
        self._build(self.mode, resumed if self.in_diloco else None)

    # -- what the loop drives -------------------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self.run.model

    @property
    def shard_index(self) -> int:
        return self._inner.shard_index

    @property
    def in_diloco(self) -> bool:
        return self.mode.algorithm == DILOCO

    def forward_backward(self, accum: int) -> torch.Tensor:
        wanted = self._wanted()
        if wanted is not None and wanted.kind != self.mode.kind:
            self._switch(wanted)
        return self._inner.forward_backward(accum)

    def end_step(self) -> None:
        self._inner.end_step()
        self.done += 1

    def local_models(self) -> list[nn.Module]:
        return [self.run.model]

    def close(self) -> None:
        # The outer loop stays referenced: recovery in place reads its state after the replica closed.
        self._teardown(keep_outer=True)
        if self._node_groups is not None:
            self._node_groups.destroy()
            self._node_groups = None

    def compressors(self) -> dict[str, InterCompressor]:
        """The 16-bit modes' compressors, by mode name, whether running or not (their residuals go in every
        checkpoint: :class:`hybrid.app.state.error_feedback.ErrorFeedback`)."""
        return self._compressors

    def summary(self) -> dict[str, Any]:
        """What metrics.json says: every switch, and the mode the run ended in."""
        out: dict[str, Any] = {"switches": self.switches,
                               "adaptive": {"modes": [str(m) for m in self.modes], "final_mode": str(self.mode),
                                            "plan": self.cfg.comm.adapt_plan}}
        if self.in_diloco:
            out.update(self._inner.summary())
        return out

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``adaptive`` entry (the same on every rank)."""
        return {"mode": self.mode.name, "sync_every": self.mode.sync_every, "kept": self._kept,
                "switches": list(self.switches), "watch": self.watch.state_dict() if self.watch else None}

    # -- the switch ---------------------------------------------------------------------------------------
    def _wanted(self) -> Mode | None:
        if self.plan is not None:
            return self.plan.due(self.done)
        return self.watch.advice if self.watch is not None else None

    def _switch(self, wanted: Mode) -> None:
        """Leave the running mode and enter ``wanted``, between steps ``done`` and ``done + 1``. Collective."""
        before, link = self.mode, self.watch.inter.mbit if self.watch is not None else None
        to = self._resolved(wanted)
        with self.counters.recorder.span("adaptive_switch", **{"from": str(before), "to": str(to)}):  # the timeline
            if self.in_diloco:
                self._leave_diloco()
            # The switch counts from here on (recovery in place continues from the new mode): leaving DiLoCo has
            # changed the state (its last sync, the inner state averaged); what follows only builds.
            self.mode = to
            self.switches.append({"step": self.done, "from": str(before), "to": str(self.mode),
                                  "link_mbit": None if link is None else round(link, 3)})
            if self.watch is not None:
                self.watch.switched(self.mode)
            self._teardown()
            self._build(self.mode, None)
        index = [m.kind for m in self.modes].index(self.mode.kind)
        self.log_scalars(self.done, {"adaptive/mode": float(index), "adaptive/switches": float(len(self.switches))})
        self.status(f"adaptive: after step {self.done}, {before} -> {self.mode}"
                            + (" (comm.adapt_plan)" if self.plan is not None else f" (inter-node link ~{link:.0f} Mbit/s)"))

    def _resolved(self, wanted: Mode) -> Mode:
        """DiLoCo at ``comm.sync_every``, or (0) at the interval the advice priced."""
        if wanted.algorithm != DILOCO:
            return wanted
        if self.cfg.comm.sync_every:
            return dataclasses.replace(wanted, sync_every=self.cfg.comm.sync_every)
        advised = self.watch.advice if self.watch is not None else None
        every = advised.sync_every if advised is not None and advised.algorithm == DILOCO else DEFAULT_SYNC_EVERY
        return dataclasses.replace(wanted, sync_every=streamable(every, self.cfg.comm.fragments,
                                                                 self.cfg.comm.overlap_steps))

    def _leave_diloco(self) -> None:
        self.outer.finish(self.done)  # every rank now holds the same weights
        self._kept = copy.deepcopy(self.outer.outer.state_dict()) if self.outer.outer is not None else None
        average_optimizer_state(self.run.optimizer, self.device, self.groups.cross)

    def _teardown(self, keep_outer: bool = False) -> None:
        if self._inner is not None:
            self._inner.close()
        if self._hook is not None:
            self._hook.close()
        self._inner = self._hook = None
        if not keep_outer:
            self.outer = None
        for p in self.run.model.parameters():
            p.grad = None  # views into the old DDP's buckets: the next DDP makes its own

    def _build(self, mode: Mode, resumed: dict[str, Any] | None) -> None:
        """DDP and the replica for ``mode``; ``resumed``: DiLoCo's checkpoint entry to continue from."""
        run, cfg = self.run, self.cfg
        if mode.algorithm == DILOCO:
            comm = dataclasses.replace(cfg.comm, sync_every=mode.sync_every, inter="hierarchical")
            self.outer = diloco.build_outer_sync(run.model, self.groups, comm, self.counters, in_place=self._in_place)
            if self._kept is not None and self.outer.outer is not None:
                self.outer.outer.load_state_dict(self._kept)
            self.outer.begin_at(self.done)
            if resumed is not None and "shared" in resumed:  # in place: the interrupted step's rest first
                self.outer.load_held(resumed["shared"], resumed["node"])
                self.outer.resume()
            elif resumed is not None:
                diloco.restore_node(resumed, self.topology.node, run.model, run.optimizer, self.outer)
            ddp = self.wrap(run.model, self.groups.intra)
            if self._node_groups is not None:
                self._hook = run.optimizer.attach(ddp, NodeCommunicator(self._node_groups, self.counters,
                                                                        cfg.comm.chunk_bytes))
            settle_buckets(ddp, self._hook, lambda: batch_loss(ddp, *self.sample, run.loss_fn).backward())
            self._inner = diloco.DilocoReplica(ddp, run.streams[0], self.device, run.loss_fn, self.outer,
                                               self.topology, self.done, cfg.trainer.max_steps, self.log_scalars,
                                               cfg.trainer.precision, self.counters.recorder, cfg.trainer.compile)
            return
        ddp = self.wrap(run.model, None)
        communicator = make_communicator(mode.algorithm, self.groups, self.counters, cfg.comm.chunk_bytes,
                                         mode.inter_compression, device=self.device)
        if mode.name in self._compressors:
            communicator.compressor = self._compressors[mode.name]  # this mode's residuals, from its last phase
        self._hook = (run.optimizer.attach(ddp, communicator) if self._node_groups is not None
                      else register_comm_hook(ddp, communicator))
        settle_buckets(ddp, self._hook, lambda: batch_loss(ddp, *self.sample, run.loss_fn).backward())
        self._inner = RankReplica(ddp, run.streams[0], self.device, run.loss_fn, cfg.trainer.precision,
                                  self.counters.recorder, cfg.trainer.compile)

    def probe(self) -> tuple[float, float]:
        """Time an all-reduce of :data:`PROBE_BYTES` among the node leaders, once they have met: DiLoCo leaves
        the link idle between its syncs. (bytes, seconds) on the leaders, zeros elsewhere. Collective over the leaders."""
        if not self.topology.is_leader:
            return 0.0, 0.0
        # Between syncs the nodes run apart: meet first, or the probe times one leader waiting for the other. The
        # meeting carries the probe's bytes too: after the link was idle, a shaper or policer lets a burst through
        # at line rate (tc's tbf: 64 KB at 20 Mbit/s), which a probe alone would read as a link twice as fast.
        dist.all_reduce(torch.zeros(PROBE_BYTES // 4, device=self.device), group=self.groups.leaders)
        probe = torch.zeros(PROBE_BYTES // 4, device=self.device)
        start = time.perf_counter()
        dist.all_reduce(probe, group=self.groups.leaders)
        if probe.is_cuda:
            torch.cuda.synchronize(probe.device)  # the all-reduce's time, not its launch's
        return float(PROBE_BYTES), time.perf_counter() - start


def average_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device, cross: Any = None) -> None:
    """Every floating-point state tensor (momentum, Adam's moments) averaged over every rank, in one all-reduce:
    after DiLoCo each node's inner optimizer had its own. Step counts are the same everywhere and stay. A
    node-sharded optimizer's shard is averaged over ``cross`` (the workers of its local rank, one per node), which
    hold the same slices."""
    sharded = isinstance(optimizer, NodeShardedOptimizer)
    if sharded and optimizer.inner is None:
        return  # not stepped yet: nothing held
    held = optimizer.inner.state if sharded else optimizer.state
    tensors = [v for state in held.values() for k, v in sorted(state.items())
               if torch.is_tensor(v) and v.is_floating_point() and k != "step" and v.numel()]
    if not tensors:  # the same on every rank of the group: they hold the same slices
        return
    group = cross if sharded else None
    flat = torch.cat([t.reshape(-1).to(device, torch.float64) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class AdaptiveState(PlainState):
    """Checkpoints of comm=adaptive: plain ones in the every-step modes, DiLoCo's inside a DiLoCo phase (every
    node's state streamed to rank 0), each with the ``adaptive`` entry. Set ``replica`` before the first save."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.replica: AdaptiveReplica | None = None
        self._diloco: diloco.DilocoState | None = None

    # What recovery in place reads of the running mode (hybrid.app.state.in_place).
    @property
    def in_diloco(self) -> bool:
        return self.replica is not None and self.replica.in_diloco

    @property
    def outer(self) -> Any:
        """DiLoCo's outer loop while in a DiLoCo phase (None elsewhere, or before it is built)."""
        return self.replica.outer if self.in_diloco else None

    @property
    def switches_done(self) -> int:
        return len(self.replica.switches) if self.replica is not None else 0

    def held_entries(self) -> dict[str, Any]:
        return {CHECKPOINT_KEY: self.replica.state_dict()} if self.replica is not None else {}

    def collect(self, model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.replica is None:
            raise RuntimeError("AdaptiveState.replica is not set: build the AdaptiveReplica before the first save")
        self._diloco = None
        if self.replica.in_diloco:
            self._diloco = diloco.DilocoState(self.topology)
            self._diloco.outer = self.replica.outer
            return self._diloco.collect(model, optimizer)
        return super().collect(model, optimizer)

    def extra(self) -> dict[str, Any]:
        # In DiLoCo only: an every-step checkpoint of a node-sharded optimizer does not collect through this state.
        extra = self._diloco.extra() if self._diloco is not None and self.in_diloco else {}
        return {**extra, CHECKPOINT_KEY: self.replica.state_dict()}

    def deferred(self) -> Any:
        return self._diloco.deferred() if self._diloco is not None and self.in_diloco else None
