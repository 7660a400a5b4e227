"""One worker of a training job: set up, train, report; in process mode (a rank under DDP) or thread mode.

:func:`run_worker` runs on every rank, under torchrun or :mod:`hybrid.runtime.launch`.
Each worker computes on its own mini-batches; the only collectives during
training are the gradient all-reduces of the chosen ``comm`` (plain DDP's, or
the hybrid communicator's through the DDP comm hook). Start-up (topology,
resume) and the end of the run (parameter checksums) exchange a little over
the default group; nothing else synchronises.

With ``cluster.intra_mode=thread`` a worker is a whole node driving its
devices' replicas (:func:`train_thread_mode`, over :mod:`hybrid.app.replicas.node_threads`); every mode
builds its state with :func:`hybrid.app.setup.set_up` and steps it with
:func:`hybrid.app.loop.train_loop`.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.app.components.losses import batch_loss
from hybrid.app.components.models import param_bytes
from hybrid.app.config import ADAPTIVE, DILOCO, IN_PLACE, TrainConfig
from hybrid.app.loop import train_and_report
from hybrid.app.observability.link_watch import LinkWatch
from hybrid.app.observability.metrics import Metrics, NullMetrics, TensorBoardMetrics
from hybrid.app.observability.run_metrics import describe_auto_calibration
from hybrid.app.replicas import adaptive, diloco
from hybrid.app.replicas.base import RankReplica
from hybrid.app.replicas.node_threads import NodeProcessCommunicator, NodeReplicas, replica_topology
from hybrid.app.replicas.torch_hooks import register_torch_hook
from hybrid.app.setup import device_for, sample_batch, set_up
from hybrid.app.state import error_feedback
from hybrid.app.state.in_memory import HELD_OUTER_KEY
from hybrid.app.state.in_place import InPlace
from hybrid.core.comm import (
    PHASES,
    AutoCommunicator,
    CommGroups,
    NodeCommunicator,
    PhaseCounters,
    group_kinds_for,
    make_communicator,
    register_comm_hook,
    settle_buckets,
)
from hybrid.core.comm.groups import resolve_backend
from hybrid.core.timeline import StepRecorder
from hybrid.core.topology import Topology, WorkerEnv, discover_topology
from hybrid.runtime.distributed import broadcast_from_rank0, init_distributed, shutdown_distributed
from hybrid.runtime.heap import limit_arenas
from hybrid.runtime.launch import PEER_GRACE_S, is_consequence
from hybrid.runtime.quorum import JobEnded

__all__ = ["buffer_sync", "run_in_place", "run_worker", "train_adaptive", "train_diloco", "train_hsdp", "train_process_mode",
           "train_thread_mode", "train_worker", "wrap_ddp"]


_BUFFER_SYNC_KEY = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                    else "broadcast_buffers")


def buffer_sync(model: torch.nn.Module) -> dict[str, bool]:
    """DDP's buffer broadcast (rank 0's buffers to every rank before each forward, as plain DDP does by default)
    where the model has state in buffers (BatchNorm's running statistics), so replicas stay identical; off where
    its buffers are constants outside the state dict (a causal mask), which would cost a needless collective
    per step."""
    state = set(model.state_dict())
    return {_BUFFER_SYNC_KEY: any(name in state for name, _ in model.named_buffers())}


def wrap_ddp(cfg: TrainConfig, model: torch.nn.Module, device: torch.device, group: Any = None) -> DDP:
    """``model`` under torch DDP with the run's options (``comm.bucket_mb``, gradients as bucket views, unused
    parameters, buffer sync), over ``group`` (None: the default group; comm=diloco's: the node's)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group,
               bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=cfg.comm.grad_as_bucket_view,
               find_unused_parameters=cfg.comm.find_unused_parameters, **buffer_sync(model))


def run_worker(cfg: TrainConfig, run_dir: str | None) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns the final metrics (also written to metrics.json)."""
    limit_arenas()  # before the groups' threads: a long run's heap stays flat (hybrid.runtime.heap)
    if cfg.cluster.recovery == IN_PLACE:
        return run_in_place(cfg, run_dir)
    env = init_distributed(cfg.comm.timeout_s)
    with _released_once_finished(shutdown_distributed):
        try:
            return _run_session(cfg, env, run_dir)
        except Exception as exc:
            _say_failed(env.rank, exc)
            raise


def run_in_place(cfg: TrainConfig, run_dir: str | None) -> dict[str, Any] | None:
    """:func:`run_worker` with ``cluster.recovery=in_place``: where a collective fails because a peer went, this
    process stays, agrees with the other survivors on who is in, and trains on (:mod:`hybrid.app.state.in_place`)."""
    session = InPlace(cfg)
    try:
        try:
            if session.over:
                raise JobEnded(f"worker {session.me.key}: the job had finished when this node came back")
            if session.joining:
                _import_meanwhile(cfg)
            env = session.join() if session.joining else session.env
        except JobEnded as ended:
            print(f"{ended}: nothing to join", file=sys.stderr, flush=True)
            return None
        while True:
            init_distributed(cfg.comm.timeout_s, session.group_store(), env)
            try:
                result = _run_session(cfg, env, run_dir, session)
            except Exception as exc:
                if not session.recoverable(exc):
                    _say_failed(env.rank, exc)
                    raise
                env = session.recover(exc)
                continue
            session.finished()
            shutdown_distributed()
            return result
    finally:
        session.close()


def _import_meanwhile(cfg: TrainConfig) -> None:
    """A worker of a returning node waits a second or more for the running workers to make room: the modules its
    set-up imports beyond what its agent had (comm=hsdp: FSDP2 and torch.distributed.checkpoint, seconds of CPU on
    a busy machine) are imported meanwhile, on a thread; the set-up's own import waits for it to finish."""
    if cfg.comm.algorithm == "hsdp":
        threading.Thread(target=importlib.import_module, args=("hybrid.app.replicas.hsdp",),
                         name="hybrid-import-meanwhile", daemon=True).start()


@contextmanager
def _released_once_finished(release: Callable[[], None]) -> Iterator[None]:
    """Call ``release`` (destroy the groups) once the block has finished; on an exception, do not: the sockets
    then close when this process exits, after its error is recorded (torchelastic's error file, and
    :func:`_say_failed`), so peers that fail on the closed connections come second."""
    yield  # an exception raised in the block is raised here, and release is skipped
    release()


def _say_failed(rank: int, exc: BaseException) -> None:
    # Said at once: the agent reports the first worker it sees exit, and a peer that finds this rank's
    # connections closed can exit before this one has recorded its error.
    print(f"rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    if is_consequence(f"{type(exc).__name__}: {exc}"):
        # A peer went first (its connections closed, or it stopped answering): leave its agent time to
        # see that death before this exit, so the cause is what gets reported first.
        time.sleep(PEER_GRACE_S)


def _run_session(cfg: TrainConfig, env: WorkerEnv, run_dir: str | None,
                 session: InPlace | None = None) -> dict[str, Any] | None:
    """Set up and train in the current default group; rank 0 returns the result."""
    metrics: Metrics = NullMetrics()
    try:
        # Under torchrun every rank has its own Hydra dir: rank 0's is the run's (after a recovery in place,
        # every survivor knows it).
        known = session.run_path if session is not None and session.run_path is not None else run_dir
        run_path = Path(broadcast_from_rank0(str(known) if known is not None else None))
        topology = discover_topology(env)
        if session is not None:
            session.begin(topology, run_path)
        device = device_for(cfg.trainer, env.local_rank)
        threads = cfg.trainer.num_threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(
            1, (os.cpu_count() or 1) // topology.local_world_size
        )
        torch.set_num_threads(threads)
        if env.rank == 0:
            metrics = TensorBoardMetrics(run_path / "tb", run_path)  # its status lines also go to train.log
        return train_worker(cfg, topology, device, run_path, metrics, env.rank, session)
    finally:
        metrics.close()


def train_worker(cfg: TrainConfig, topology: Topology, device: torch.device, run_path: Path,
                 metrics: Metrics, rank: int, session: InPlace | None = None) -> dict[str, Any] | None:
    """This worker's part of the run, in the mode ``cluster.intra_mode`` asks for; rank 0 returns the result.
    ``session``: recovery in place's (process mode, DDP-based comms: the configuration refuses the others)."""
    if cfg.cluster.intra_mode == "thread":
        # This process is a whole node driving its devices' replicas (nn.DataParallel-style); same loop.
        return train_thread_mode(cfg, topology, device, run_path, metrics, session)
    return train_process_mode(cfg, topology, device, run_path, metrics, rank, session)


def train_process_mode(cfg: TrainConfig, topology: Topology, device: torch.device, run_path: Path,
                       metrics: Metrics, rank: int, session: InPlace | None = None) -> dict[str, Any] | None:
    """One replica per process: this rank's model under DDP, its buckets averaged by ``comm`` (or, comm=hsdp,
    sharded by torch FSDP2)."""
    if cfg.comm.algorithm == "hsdp":
        return train_hsdp(cfg, topology, device, run_path, metrics, rank, session)
    if cfg.comm.algorithm == DILOCO:
        return train_diloco(cfg, topology, device, run_path, metrics, rank, session)
    if cfg.comm.algorithm == ADAPTIVE:
        return train_adaptive(cfg, topology, device, run_path, metrics, rank, session)
    run = set_up(cfg, [topology.rank], topology.world_size, topology.node_sizes, device, run_path, metrics, rank,
                 held=session.held if session is not None else None)
    if session is not None:
        session.watch(run)
    ddp = wrap_ddp(cfg, run.model, device)
    counters = PhaseCounters(StepRecorder(PHASES))  # the phases also feed the per-rank accounts and the timeline
    hook = groups = comm = replicas = None
    with _released_once_finished(lambda: groups.destroy() if groups is not None else None):
        try:
            if cfg.comm.algorithm != "ddp":
                groups = CommGroups.build(topology, cfg.comm.intra_backend, cfg.comm.inter_backend,
                                          cfg.comm.timeout_s, kinds=group_kinds_for(cfg.comm.algorithm, topology,
                                                                                    cfg.comm.shard_optimizer))
                comm = make_communicator(cfg.comm.algorithm, groups, counters, cfg.comm.chunk_bytes,
                                         cfg.comm.inter_compression, device=device,
                                         shards_optimizer=cfg.comm.shard_optimizer)
                if isinstance(comm, AutoCommunicator):
                    metrics.status(describe_auto_calibration(comm))
                # comm.shard_optimizer: the optimizer's hook averages only this worker's shard of each bucket.
                hook = (run.optimizer.attach(ddp, comm) if cfg.comm.shard_optimizer
                        else register_comm_hook(ddp, comm))
            if comm is not None:
                for compressor in comm.compressors().values():  # the 16-bit hop's guard
                    cfg.comm.guarded(compressor)
            feedback = error_feedback.ErrorFeedback.attach(run.residual_signature, comm, run.residuals, device)
            # The first real step already sees DDP's rebuilt buckets, as every later one does: a resumed run
            # then sums each element in the order the uninterrupted run did, and residuals keyed by bucket apply.
            x, y = sample_batch(run.dataset, cfg.data.batch_size, device)
            settle_buckets(ddp, hook, lambda: batch_loss(ddp, x, y, run.loss_fn).backward())
            if comm is None:
                # comm.torch_hook (none: DDP's own all-reduce), after the settling backward, which would otherwise
                # count as one of PowerSGD's warm-up iterations.
                register_torch_hook(ddp, cfg.comm)
            replicas = RankReplica(ddp, run.streams[0], device, run.loss_fn, cfg.trainer.precision,
                                   counters.recorder, cfg.trainer.compile)
            return train_and_report(cfg, run, replicas, topology, metrics, counters, run_path, rank, device,
                                    feedback, comm)
        finally:
            if replicas is not None:
                replicas.close()
            if hook is not None:
                hook.close()


def train_diloco(cfg: TrainConfig, topology: Topology, device: torch.device, run_path: Path, metrics: Metrics,
                 rank: int, session: InPlace | None = None) -> dict[str, Any] | None:
    """comm=diloco: this rank's model under DDP over its node's group (gradients averaged inside the node every
    step), and the outer loop among nodes every ``comm.sync_every`` steps (:mod:`hybrid.app.replicas.diloco`).
    ``session``: recovery in place's; a state held in memory continues its interrupted outer step first."""
    kinds = diloco.diloco_group_kinds(cfg.comm, topology)
    state = diloco.DilocoState(topology)
    run = set_up(cfg, [topology.rank], topology.world_size, topology.node_sizes, device, run_path, metrics, rank,
                 state, held=session.held if session is not None else None)
    groups = CommGroups.build(topology, cfg.comm.intra_backend, cfg.comm.inter_backend, cfg.comm.timeout_s,
                              kinds=kinds)
    counters = PhaseCounters(StepRecorder(PHASES))  # the outer loop's exchanges: inter_allreduce, intra_broadcast
    outer = state.outer = diloco.build_outer_sync(run.model, groups, cfg.comm, counters, in_place=session is not None)
    held = run.resumed_extra.get(HELD_OUTER_KEY)
    if held is not None:  # in place: the exchanges in flight start again over these groups
        outer.load_held(held["shared"], held["node"])
    else:
        note = diloco.restore_node(run.resumed_extra.get(diloco.CHECKPOINT_KEY), topology.node, run.model,
                                   run.optimizer, outer)
        outer.begin_at(run.start_step)
        if note:
            metrics.status(note)
    if session is not None:
        session.watch(run)  # from here a failure offers this run's state (before: the state it was given)
    if held is not None:
        outer.resume()  # what the interrupted step had left to do
    ddp = wrap_ddp(cfg, run.model, device, groups.intra)
    replicas = hook = node_groups = None

    def destroy() -> None:
        groups.destroy()
        if node_groups is not None:
            node_groups.destroy()

    with _released_once_finished(destroy):
        try:
            if cfg.comm.shard_optimizer:
                # The inner optimizer sharded over the node's workers, on a node group of its own (DDP's is busy with
                # DDP's own broadcasts, the outer loop's with its exchanges): each averages its shard of a bucket
                # inside the node and the node gathers the updated weights, as ZeRO-1 does under the every-step comms.
                node_groups = CommGroups.build(topology, cfg.comm.intra_backend, cfg.comm.inter_backend,
                                               cfg.comm.timeout_s, kinds=("intra",))
                hook = run.optimizer.attach(ddp, NodeCommunicator(node_groups, counters, cfg.comm.chunk_bytes))
            x, y = sample_batch(run.dataset, cfg.data.batch_size, device)
            settle_buckets(ddp, hook, lambda: batch_loss(ddp, x, y, run.loss_fn).backward())
            replicas = diloco.DilocoReplica(ddp, run.streams[0], device, run.loss_fn, outer, topology, run.start_step,
                                            cfg.trainer.max_steps, metrics.scalars, cfg.trainer.precision,
                                            counters.recorder, cfg.trainer.compile)
            return train_and_report(cfg, run, replicas, topology, metrics, counters, run_path, rank, device, None)
        finally:
            if replicas is not None:
                replicas.close()
            if hook is not None:
                hook.close()


def train_adaptive(cfg: TrainConfig, topology: Topology, device: torch.device, run_path: Path, metrics: Metrics,
                   rank: int, session: InPlace | None = None) -> dict[str, Any] | None:
    """comm=adaptive: every-step hierarchical or sharded, or DiLoCo, as the measured link (or comm.adapt_plan)
    calls for, switched between steps on every rank alike (:mod:`hybrid.app.replicas.adaptive`). ``session``:
    recovery in place's."""
    state = adaptive.AdaptiveState(topology)
    run = set_up(cfg, [topology.rank], topology.world_size, topology.node_sizes, device, run_path, metrics, rank,
                 state, held=session.held if session is not None else None)
    groups = CommGroups.build(topology, cfg.comm.intra_backend, cfg.comm.inter_backend, cfg.comm.timeout_s,
                              kinds=adaptive.GROUP_KINDS)
    counters = PhaseCounters(StepRecorder(PHASES))  # every mode's phases, and DiLoCo's exchanges

    replicas = None
    with _released_once_finished(groups.destroy):
        try:
            sample = sample_batch(run.dataset, cfg.data.batch_size, device)
            modes = adaptive.adaptive_modes(cfg)
            watch = LinkWatch(cfg.comm.adapt_every, topology.layout, param_bytes(run.model), modes[0], metrics,
                              cfg.cluster.testbed.nics_in_use,
                              modes, slack=cfg.comm.adapt_slack) if cfg.comm.adapt_every else None
            replicas = state.replica = adaptive.AdaptiveReplica(cfg, topology, groups, counters, run, device,
                                                                lambda model, group: wrap_ddp(cfg, model, device, group),
                                                                sample, watch, metrics.scalars, metrics.status)
            if session is not None:
                session.watch(run)  # from here a failure offers this run's state (before: the state it was given)
            if watch is not None:
                watch.probe = replicas.probe  # the link between DiLoCo's syncs
                watch.diloco_overlaps = cfg.comm.overlap
            # Its 16-bit modes' residuals, in and out of checkpoints.
            feedback = error_feedback.ErrorFeedback.attach(run.residual_signature, replicas, run.residuals, device)
            return train_and_report(cfg, run, replicas, topology, metrics, counters, run_path, rank, device,
                                    feedback)
        finally:
            if replicas is not None:
                replicas.close()


def train_hsdp(cfg: TrainConfig, topology: Topology, device: torch.device, run_path: Path, metrics: Metrics,
               rank: int, session: InPlace | None = None) -> dict[str, Any] | None:
    """comm=hsdp: this rank's shards of the model under torch FSDP2 on a (nodes, workers per node) mesh; the
    same loop, checkpoints (through torch's distributed state-dict API) and metrics as every other comm.
    ``session``: recovery in place's; each session shards a new model over its membership's mesh."""
    # Imported here, not at the top: FSDP2 and torch.distributed.checkpoint cost every worker process seconds of
    # CPU to import (experiments/RESULTS.md), which runs of the other comms need not pay.
    from hybrid.app.replicas.hsdp import HsdpReplica, ShardedState, hsdp_mesh

    # The mesh's groups live as long as the default group (FSDP2 may still hold them after the run).
    run = set_up(cfg, [topology.rank], topology.world_size, topology.node_sizes, device, run_path, metrics, rank,
                 ShardedState(hsdp_mesh(topology, device, cfg.comm.timeout_s)),
                 held=session.held if session is not None else None)
    if session is not None:
        session.watch(run)
    counters = PhaseCounters(StepRecorder(PHASES))  # no hybrid phases: FSDP2's collectives sit inside the loop parts
    replicas = HsdpReplica(run.model, run.streams[0], device, run.loss_fn, topology.local_rank,
                           cfg.trainer.precision, counters.recorder)
    try:
        return train_and_report(cfg, run, replicas, topology, metrics, counters, run_path, rank, device, None)
    finally:
        replicas.close()


def train_thread_mode(cfg: TrainConfig, processes: Topology, device: torch.device, run_path: Path,
                      metrics: Metrics, session: InPlace | None = None) -> dict[str, Any] | None:
    """Train this node's replicas; the process of node 0 returns the final metrics (also in metrics.json).
    ``session``: recovery in place's (a node is one process: the survivors' node processes keep theirs)."""
    if set(processes.node_sizes) != {1}:
        raise ValueError(
            f"cluster.intra_mode=thread runs one process per node, but the nodes have {list(processes.node_sizes)} "
            "processes: start torchrun with --nproc-per-node 1"
        )
    per_node = cfg.cluster.nproc_per_node
    if device.type == "cuda":
        if per_node > torch.cuda.device_count():
            raise ValueError(f"cluster.nproc_per_node={per_node} but this node has {torch.cuda.device_count()} "
                             "GPU(s): one replica per GPU")
        devices = [torch.device("cuda", i) for i in range(per_node)]
    else:
        devices = [device] * per_node
    topology = replica_topology(processes, per_node)
    run = set_up(cfg, topology.node_ranks, topology.world_size, topology.node_sizes, devices[0], run_path, metrics,
                 processes.rank, held=session.held if session is not None else None)
    if session is not None:
        session.watch(run)
    # The gradients' own group (not the default one, which carries the loop's start-up and checksum exchanges).
    backend = resolve_backend(cfg.comm.inter_backend, "inter")
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=cfg.comm.timeout_s))
    comm = NodeProcessCommunicator(topology, group, backend, cfg.comm.timeout_s, devices[0],
                                   inter_compression=cfg.comm.inter_compression)
    feedback = error_feedback.ErrorFeedback.attach(run.residual_signature, comm, run.residuals, devices[0])
    replicas = NodeReplicas(run.model, devices, run.streams, comm, bucket_bytes=max(1, int(cfg.comm.bucket_mb * 2**20)),
                            timeout_s=cfg.comm.timeout_s,
                            threads_per_replica=max(1, torch.get_num_threads() // per_node),
                            loss_fn=run.loss_fn, precision=cfg.trainer.precision)
    with _released_once_finished(lambda: dist.destroy_process_group(group)):
        try:
            return train_and_report(cfg, run, replicas, topology, metrics, replicas.counters, run_path,
                                    topology.rank, devices[0], feedback)
        finally:
            replicas.close()
