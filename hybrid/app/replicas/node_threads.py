"""DP-style nodes (``cluster.intra_mode=thread``): one process per node drives all of the node's devices.

In the default ``process`` mode every device has a process of its own and
gradients travel through the hierarchical communicator. In ``thread`` mode a
node's single process does with its G = ``cluster.nproc_per_node`` devices what
:class:`torch.nn.DataParallel` does, and only the node processes talk:

1. G replicas of the model, one per device (cuda:0..G-1; on CPU, G copies in
   memory), all equal to the leader (replica 0);
2. each replica's forward, loss and backward in a thread of its own
   (autograd on independent graphs is thread-safe; torch's ops release the GIL);
3. the replicas' gradients summed onto the leader in a fixed order
   (``intra_reduce``), the leader's gradients all-reduced among the node
   processes in a few flat buckets (``inter_allreduce``), the sum divided by
   N = nnodes x G;
4. the optimizer steps the leader alone, whose parameters are then copied
   into the other replicas (``intra_broadcast``).

Replica r of node n reads exactly the batches global rank n*G + r reads in
process mode, and the sums are grouped as the hierarchical communicator
groups them (inside the node, then across nodes, then one division), so both
modes train the same run up to floating-point rounding, and a checkpoint of
one mode resumes in the other. Everything around the step (schedule,
non-finite gradients, logging, checkpoints, replica checks, metrics.json) is
the trainer's own loop, driving a :class:`NodeReplicas` instead of a DDP model.

What it costs: the replicas' threads share one interpreter, so the Python
work of every op is serialised by the GIL (small models suffer most); the
gradient reduction starts once every replica's backward is done (DDP's
buckets overlap it with backward); and every step copies the parameters into
G-1 replicas, where process mode broadcasts the gradients and lets each
process step its own optimizer.
"""

from __future__ import annotations

import copy
import threading
import time
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from hybrid.app.components.data import BatchStream
from hybrid.app.components.losses import LossFn, batch_loss, move_to
from hybrid.app.replicas.base import autocast_for
from hybrid.core.comm import CommGroups, Communicator, PhaseCounters
from hybrid.core.comm.counters import rooted_bytes
from hybrid.core.timeline import StepRecorder
from hybrid.core.topology import Topology

__all__ = ["NodeProcessCommunicator", "NodeReplicas", "replica_topology"]


def replica_topology(processes: Topology, per_node: int) -> Topology:
    """The N-rank mesh a thread-mode job trains as, seen from this node's leader replica.

    ``processes`` has one rank per node; replica r of node n is global rank n * per_node + r.
    """
    nodes = tuple(tuple(range(n * per_node, (n + 1) * per_node)) for n in range(processes.nnodes))
    return Topology(rank=processes.node * per_node, nodes=nodes)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # honest phase times: a local wait, not a collective


def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """One new contiguous buffer holding ``params``' gradients (zeros where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


class NodeProcessCommunicator(Communicator):
    """Thread mode's inter-node hop: a sum among the node processes, as hierarchical's leaders do it.

    Over the N-rank ``topology`` (see :func:`replica_topology`) the node
    processes are the node leaders, and ``group`` is their group; so this is
    :class:`hybrid.core.comm.HierarchicalCommunicator`'s middle phase, with the
    same division rule, inter-node compression and counters, and the
    intra-node phases left to :class:`NodeReplicas`' threads. :meth:`start` /
    :meth:`finish` let the replicas keep several buckets in flight. A failure
    names the node and its leader replica's global rank (node x G), the rank
    that process mode's leader of that node would have.

    Each process passes its node's *sum* over its G replicas: ``all_reduce_mean_``
    then returns the mean over all N replicas (the sum over the nodes / N).
    """

    name = "hierarchical (intra_mode=thread)"
    compresses_inter = True
    group_kinds = ("leaders",)

    def __init__(self, topology: Topology, group: Any, backend: str, timeout_s: float, device: torch.device,
                 counters: PhaseCounters | None = None, inter_compression: str = "none") -> None:
        groups = CommGroups(topology, backend, backend, timedelta(seconds=timeout_s), world=None, intra=None,
                            leaders=group, cross=None, kinds=frozenset(self.group_kinds))
        super().__init__(groups, counters, inter_compression=inter_compression)
        self.device = device

    def start(self, flat: torch.Tensor, key: Any, divisor: int | None) -> Any:
        """Start summing ``flat`` (the node's sum of a bucket) over the nodes; :meth:`finish` completes it."""
        if self.topology.nnodes == 1:
            return None
        return self._start_inter(flat, self.groups.leaders, divisor, key)

    def finish(self, flat: torch.Tensor, started: Any, divisor: int | None) -> None:
        """Wait for :meth:`start`'s sum, then divide by ``divisor`` once (unless the compressed wire was
        divided before it left)."""
        divided = started is not None and self._finish_inter(flat, started, self.topology.nnodes)
        if divisor is not None and not divided:
            self._divide_(flat, divisor)

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Any, gather: bool = True) -> None:
        self.finish(flat, self.start(flat, key, divisor), divisor)

    def _wait(self, phase: str, works: list, nbytes: int) -> None:
        with self._phase(phase, nbytes):
            for work in works:
                work.wait()
            _synchronize(self.device)


class NodeReplicas:
    """This node's G replicas, driven as nn.DataParallel drives its devices; what the trainer loop steps.

    ``module`` is the leader (replica 0, on the first device): the optimizer,
    checkpoints and checksums see only it. Collective across the node
    processes: every node calls :meth:`forward_backward` once per step.
    """

    shard_index = 0  # every replica holds the whole model

    def __init__(self, leader: nn.Module, devices: list[torch.device], streams: list[BatchStream],
                 comm: NodeProcessCommunicator, *, bucket_bytes: int, timeout_s: float,
                 threads_per_replica: int, loss_fn: LossFn, precision: str = "fp32") -> None:
        if len(devices) != len(streams):
            raise ValueError(f"{len(devices)} devices but {len(streams)} batch streams: one each per replica")
        self.module = leader
        self.devices, self.streams, self.comm, self.timeout_s = devices, streams, comm, timeout_s
        self.topology, self.counters = comm.topology, comm.counters
        # Copied from the leader as it stands (after any resume): every replica starts identical.
        self.replicas = [leader] + [copy.deepcopy(leader).to(d) for d in devices[1:]]
        # Trainable parameters only: a frozen one keeps no gradient (as under DDP) and is never stepped.
        self._params = [[p for p in m.parameters() if p.requires_grad] for m in self.replicas]
        self._buffers = [list(m.buffers()) for m in self.replicas]
        self._loss_fn = loss_fn
        self._param_bytes = sum(p.nbytes for p in self._params[0])
        self._buckets = self._bucket(bucket_bytes)
        # Intra-op threads per replica thread: the replicas share this process's cores.
        self._threads_per_replica = threads_per_replica
        self._precision = precision

    def _bucket(self, bucket_bytes: int) -> list[list[int]]:
        """Parameter indices in order, cut into buckets of at most ``bucket_bytes`` (at least one each)."""
        buckets: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self._params[0]):
            if buckets[-1] and size + p.nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += p.nbytes
        return buckets

    def local_models(self) -> list[nn.Module]:
        """Every replica of this node, in global rank order (for parameter checksums)."""
        return list(self.replicas)

    def forward_backward(self, accum: int) -> torch.Tensor:
        """Every micro-step of one step on every replica, then the gradients averaged over all N into the
        leader; returns the leader's loss (summed over the micro-steps, each divided by ``accum``)."""
        rec = self.counters.recorder or StepRecorder(())
        # Read on this thread, in order, as DataParallel scatters on the calling thread: the threads only compute.
        with rec.span("data"):
            batches = [[next(stream) for _ in range(accum)] for stream in self.streams]
        losses: list[Any] = [None] * len(self.replicas)

        def run(r: int) -> None:
            torch.set_num_threads(self._threads_per_replica)
            try:
                losses[r] = self._replica_step(r, batches[r], accum)
            except BaseException as exc:  # handed to the calling thread below
                losses[r] = exc

        # Daemon threads, one per replica and step (cheap next to a forward and backward): one stuck past the
        # deadline cannot keep the process from exiting with the error, as a pool's joined workers would.
        # The replicas' forward and backward, in threads, are one span ("backward"); averaging follows it.
        with rec.span("backward"):
            threads = [threading.Thread(target=run, args=(r,), name=f"replica-{r}", daemon=True)
                       for r in range(len(self.replicas))]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + self.timeout_s
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        rec.mark_compute_end()
        slow = [r for r, thread in enumerate(threads) if thread.is_alive()]
        if slow:
            raise TimeoutError(f"replica(s) {slow} of node {self.topology.node} did not finish forward and backward "
                               f"within comm.timeout_s={self.timeout_s:g}")
        for loss in losses:
            if isinstance(loss, BaseException):
                raise loss
        self._sync_gradients()
        return losses[0]

    def _replica_step(self, r: int, batches: list[tuple[torch.Tensor, torch.Tensor]], accum: int) -> torch.Tensor:
        model, device = self.replicas[r], self.devices[r]
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            total = torch.zeros((), device=device)
            for x, y in batches:
                x, y = move_to(x, device, non_blocking=True), move_to(y, device, non_blocking=True)
                with autocast_for(device, self._precision):
                    loss = batch_loss(model, x, y, self._loss_fn) / accum
                loss.backward()
                total += loss.detach()
            return total

    def _sync_gradients(self) -> None:
        """intra_reduce bucket by bucket, each bucket's inter-node all-reduce starting as soon as it is summed."""
        g, n, leader_device = len(self.replicas), self.topology.world_size, self.devices[0]
        in_flight = []
        for k, bucket in enumerate(self._buckets):
            start = time.perf_counter()
            flat = _flat_grads([self._params[0][i] for i in bucket])
            for r in range(1, g):  # fixed order: the same sum on every run
                flat.add_(_flat_grads([self._params[r][i] for i in bucket]).to(leader_device, non_blocking=True))
            _synchronize(leader_device)
            # Bytes as the counters count them (a bandwidth-optimal reduce): what process mode's ranks report.
            self.counters.add("intra_reduce", time.perf_counter() - start, rooted_bytes(flat.nbytes, g), start)
            in_flight.append((bucket, flat, self.comm.start(flat, (k, flat.numel()), n)))
        for bucket, flat, started in in_flight:
            self.comm.finish(flat, started, n)
            params = [self._params[0][i] for i in bucket]
            for p, reduced in zip(params, torch.split(flat, [p.numel() for p in params])):
                if p.grad is None:
                    p.grad = reduced.view_as(p).clone()
                else:
                    p.grad.copy_(reduced.view_as(p))

    def end_step(self) -> None:
        """After the optimizer step (or a skipped one): the other replicas take the leader's parameters and
        buffers (DataParallel's re-replication; DDP's buffer broadcast from rank 0) and drop their gradients."""
        if len(self.replicas) == 1:
            return
        start = time.perf_counter()
        with torch.no_grad():
            for params in self._params[1:]:
                for p, q in zip(params, self._params[0]):
                    p.copy_(q, non_blocking=True)
                    p.grad = None
            for buffers in self._buffers[1:]:
                for b, c in zip(buffers, self._buffers[0]):
                    b.copy_(c, non_blocking=True)
        for device in dict.fromkeys(self.devices):
            _synchronize(device)
        self.counters.add("intra_broadcast", time.perf_counter() - start,
                          rooted_bytes(self._param_bytes, len(self.replicas)), start)

    def close(self) -> None:
        """Nothing to release: the replica threads end with each step (or, stuck, with the process)."""
