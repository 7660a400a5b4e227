"""Typed settings of a training run.

:class:`TrainSchema` is what Hydra validates every config and override against
(registered in :mod:`hybrid.app.checks`): typed sections for the cluster, the
communicator and the trainer, open ``_target_`` nodes for the pluggable model,
data, loss and optimizer. :func:`validate` turns the composed schema
(``OmegaConf.to_object``) into a :class:`TrainConfig`, the plain objects the
trainer receives (no DictConfig crosses into the training code), adding the
checks a type cannot express (ranges, choices, which data a built-in model
takes), each failing with one line that names the key, the bad value and what
is allowed.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hybrid.app.targets import Component, component_of, current_target, label_of
from hybrid.core.adaptive import MODE_MARGIN, ModePlan
from hybrid.core.comm.compression import INTER_COMPRESSIONS, InterCompressor
from hybrid.core.comm.options import check_comm_options, one_of
from hybrid.core.comm.registry import CHOOSABLE
from hybrid.core.diloco import CODECS, INTER_MODES
from hybrid.core.topology import Layout
from hybrid.runtime.link_schedule import LinkSchedule
from hybrid.runtime.testbed import MAX_NICS, per_node_cpus, per_node_rates

# The built-in components this module knows by their _target_: which inputs each model takes (a generated
# dataset, data=synthetic with kind auto, makes these), and the two built-in datasets that pairing rules name.
INPUT_KIND = {
    "hybrid.app.components.models.MLP": "vectors",
    "hybrid.app.components.models.CNN": "images",
    "hybrid.app.components.models.Transformer": "tokens",
    "hybrid.app.components.models.gpt2": "tokens",
}
SYNTHETIC_TARGET = "hybrid.app.components.datasets.synthetic"
TEXT_TARGET, TEXT_KIND = "hybrid.app.components.datasets.text", "tokens"

__all__ = [
    "ADAPTIVE",
    "COMM_ALGORITHMS",
    "DEFAULT_OUTER_OPTIM",
    "DILOCO",
    "DILOCO_KEYS",
    "REFERENCE_COMMS",
    "TORCH_HOOKS",
    "CONF_PACKAGE",
    "ClusterConfig",
    "CommConfig",
    "DATA_KEYS",
    "DataConfig",
    "OPTIM_KEYS",
    "OptimConfig",
    "TrainConfig",
    "TrainSchema",
    "check_pairing",
    "TestbedConfig",
    "TrainerConfig",
    "outer_optimizer",
    "packaged_conf_dir",
    "resume_continues_this_run",
    "resume_target",
    "validate",
]

# The repository's conf/, installed inside the package as hybrid.conf (pyproject.toml maps it), so a wheel
# carries its configs and Hydra finds them from any directory.
CONF_PACKAGE = "hybrid.conf"

SCHEDULES = ("cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")
NONFINITE_ACTIONS = ("stop", "skip")
ELASTIC_LR = ("keep", "scale")
PRECISIONS = ("fp32", "bf16")
INTRA_MODES = ("process", "thread")
# cluster.recovery: how an elastic job survives a lost node (docs/reliability.md). restart: torch elastic restarts
# every worker on the smaller membership, which resumes from the last checkpoint; in_place: the survivors'
# processes stay, rebuild their process groups and continue from the last step they completed (hybrid.app.state.in_place).
IN_PLACE = "in_place"
RECOVERY_MODES = ("restart", IN_PLACE)
# cluster.rdzv_backend: where the agents meet and the workers agree in place (docs/reliability.md). c10d: one
# TCPStore (node 0's agent, or a process of its own off the nodes); etcd: a replicated etcd cluster.
RDZV_BACKENDS = ("c10d", "etcd")


@dataclass
class TestbedConfig:
    """Run each simulated node in its own network namespace behind a shaped link (hybrid.runtime.testbed)."""

    enabled: bool = False
    # Each NIC's rate, both directions, Mbit/s: one for every node, or a list with one per node (a degraded node).
    link_mbit: Any = 500.0
    nics_per_node: int = 1  # NICs per node, each shaped to its node's rate; gloo uses all of them
    burst_kb: float = 0.0  # tbf burst; 0 = one 4 ms tick at the rate, at least 64 KB
    latency_ms: float = 50.0  # tbf queue limit
    # CPUs each node may use (a cgroup's CFS quota): one number for every node or a list with one per node
    # (a node that computes slower); null: no limit.
    cpu_quota: Any = None
    # The links' rate changing while the job runs: [[at, mbit], ...], mbit one rate or one per node, at in steps
    # done (applied between steps, on every node at once) or, with link_schedule_unit=s, seconds since the launch.
    link_schedule: Any = None
    link_schedule_unit: str = "step"

    def rates(self, nnodes: int) -> list[float]:
        """One rate per node."""
        return per_node_rates(self.link_mbit, nnodes)

    def cpus(self, nnodes: int) -> list[float] | None:
        """One CPU limit per node, or None."""
        return None if self.cpu_quota is None else per_node_cpus(self.cpu_quota, nnodes)

    @property
    def nics_in_use(self) -> int:
        """NICs per node the job's inter-node traffic can spread over: the testbed's, or one off it."""
        return self.nics_per_node if self.enabled else 1

    def schedule(self, nnodes: int) -> LinkSchedule | None:
        """The link schedule, checked, or None."""
        if self.link_schedule is None:
            return None
        entries = self.link_schedule
        if not isinstance(entries, (list, tuple)) or not entries:
            raise ValueError(f"cluster.testbed.link_schedule={entries!r} must be a non-empty list of [at, mbit]")
        return LinkSchedule.parse(entries, self.link_schedule_unit, nnodes)


@dataclass
class ClusterConfig:
    nnodes: int = 2
    nproc_per_node: int = 2
    launch_timeout_s: float = 3600.0  # whole-job deadline of a local launch
    # Elastic restarts of a node's workers after a failure; they resume from the last checkpoint. -1: automatic:
    # none, or for an elastic job (min_nnodes < nnodes) one per node it may lose.
    max_restarts: int = -1
    # Elastic membership: the job goes on while at least this many nodes are left (torchrun's --nnodes MIN:MAX);
    # 0: cluster.nnodes, every node is needed. The survivors re-rendezvous and resume from the last checkpoint.
    # Any node, node 0 included: the local launcher and the testbed run the rendezvous store off the nodes
    # (docs/reliability.md). A fresh job may also start on MIN nodes if the others join
    # later than rdzv_last_call_s; they are taken in at the next membership change.
    min_nnodes: int = 0
    # With min_nnodes < nnodes: how long a rendezvous that has its minimum waits for more nodes (torch's
    # last_call_timeout); a node that is lost is declared dead after ~3 s without a heartbeat.
    rdzv_last_call_s: int = 10
    # process: one process per device; thread: one process per node drives its nproc_per_node devices
    # (nn.DataParallel-style replicas in threads; hybrid.app.replicas.node_threads)
    intra_mode: str = "process"
    # hydra/launcher=slurm: the rendezvous port on the job's first host (firewalled sites); 0: derived from
    # the Slurm job id (20000-31999), so concurrent jobs sharing a first host rarely meet on one port
    rdzv_port: int = 0
    # HOST:PORT of a rendezvous store that no training node hosts (one you run, e.g. python -m
    # hybrid.runtime.rdzv_store HOST PORT, or any c10d TCPStore server): every node's agent joins it as a client,
    # so losing any node, node 0 included, is survivable. "": node 0 hosts it (an elastic local job runs its own
    # off the nodes). Not with the testbed, which runs its own in a namespace of its own. With
    # rdzv_backend=etcd: the members of an etcd cluster, H1:P1,H2:P2,... (any, Slurm and torchrun included).
    rdzv_endpoint: str = ""
    # Where the agents rendezvous and the workers agree in place: c10d (one TCPStore, as above) or etcd (a
    # replicated store: losing one of its members loses nothing; a local or testbed job without rdzv_endpoint
    # starts a 3-member cluster of Debian's etcd-server for itself).
    rdzv_backend: str = "c10d"
    # How an elastic job (min_nnodes < nnodes) survives a lost node: restart (every worker restarts and resumes
    # from the last checkpoint) or in_place (no process restarts: the survivors rebuild their groups and go on
    # from the last step they completed; process mode, comm ddp/flat/hierarchical/sharded/auto).
    recovery: str = "restart"
    testbed: TestbedConfig = field(default_factory=TestbedConfig)

    @property
    def restarts(self) -> int:
        """``max_restarts``, with -1 resolved: 0, or ``nnodes - min_nnodes`` for an elastic job."""
        if self.max_restarts >= 0:
            return self.max_restarts
        return self.nnodes - self.min_nnodes if 0 < self.min_nnodes < self.nnodes else 0


# "ddp" is torch DDP's own all-reduce (no hook, or one of torch's own hooks, comm.torch_hook): the reference
# every algorithm is checked against; "hsdp" is torch FSDP2 on a (nodes, workers per node) mesh, the peer a
# user would try first (hybrid.app.replicas.hsdp); "auto" picks flat, hierarchical or sharded per bucket size from a
# cost model calibrated at start-up.
REFERENCE_COMMS = ("ddp", "hsdp")
# "diloco" is hierarchical in time: gradients averaged inside each node every step, nodes meet every
# comm.sync_every steps (hybrid.core.diloco, hybrid.app.replicas.diloco).
DILOCO = "diloco"
# "adaptive" moves between every-step hierarchical or sharded and DiLoCo as the measured inter-node link changes
# (hybrid.app.replicas.adaptive, docs/adaptive.md).
ADAPTIVE = "adaptive"
# The comms comm.shard_optimizer works with: inside each node (sharded, hierarchical; auto among those two; diloco,
# whose inner steps average and gather inside the node; adaptive, moving between those), or, comm=ddp, torch's own
# ZeroRedundancyOptimizer over every rank of the job (the reference: its parameter exchange crosses nodes).
SHARDS_OPTIMIZER = ("sharded", "hierarchical", "auto", DILOCO, ADAPTIVE, "ddp")
# The modes comm=adaptive may move between (comm.adapt_modes), and those it moves between unless told: every step
# in fp32, every step with the 16-bit inter-node hop (+bf16, with error feedback), DiLoCo; most faithful first.
ADAPTIVE_MODES = ("hierarchical", "sharded", "hierarchical+bf16", "sharded+bf16", DILOCO)
DEFAULT_ADAPT_MODES = ("hierarchical", "sharded", DILOCO)
COMM_ALGORITHMS = (*CHOOSABLE, *REFERENCE_COMMS, DILOCO, ADAPTIVE)
# comm=diloco's outer optimizer when comm.outer_optim is not given: the paper's Nesterov SGD.
# comm=diloco's own keys of the comm node (refused under another comm; the train benchmark passes them to its
# DiLoCo configurations only).
DILOCO_KEYS = ("sync_every", "inter", "fragments", "overlap", "overlap_steps", "outer_optim")
DEFAULT_OUTER_OPTIM = {"_target_": "torch.optim.SGD", "_partial_": True, "lr": 0.7, "momentum": 0.9,
                       "nesterov": True}
# comm.adapt_every: the comms whose inter-node phase the link watch times.
ADAPTS = ("hierarchical", "sharded", ADAPTIVE)
# comm.torch_hook: torch's own DDP communication hooks (torch.distributed.algorithms.ddp_comm_hooks), comm=ddp only.
TORCH_HOOKS = ("none", "bf16", "fp16", "powersgd")


@dataclass
class CommConfig:
    """How gradients travel (the Hydra ``comm`` group): the communicator's settings, handed to the parts that
    build it, and validated here, at the edge, rather than in the core."""

    algorithm: str = "hierarchical"
    bucket_mb: float = 25.0
    intra_backend: str = "auto"
    inter_backend: str = "auto"
    timeout_s: float = 300.0
    pipeline_chunk_mb: float = 4.0  # two-level algorithms pipeline large buckets in pieces of this size
    # DDP's gradient_as_bucket_view: gradients live inside the buckets, so no copy
    # of every gradient into its bucket and back after the all-reduce, and no
    # second full-size gradient buffer (the trainer zeroes gradients in place so they
    # stay views). Applies to every comm, ddp included.
    grad_as_bucket_view: bool = True
    # DDP's find_unused_parameters: needed where some steps leave parameters without a gradient (per-rank
    # control flow, a branch not taken); it costs a walk of the autograd graph per step, so off by default.
    find_unused_parameters: bool = False
    # none | bf16 | fp16: the inter-node all-reduce of hierarchical / sharded travels in 16 bits, with
    # error feedback; the intra-node phases stay full precision.
    inter_compression: str = "none"
    # With inter_compression: every compression_check_every steps one bucket also travels in full precision;
    # where the 16-bit result is off by more than max_compression_error (relative), the hop falls back to full
    # precision for the rest of the run (0: no check).
    compression_check_every: int = 100
    max_compression_error: float = 0.05
    # comm=ddp only: one of torch's own DDP hooks, as a user would register it (the compressed peers of
    # inter_compression). bf16/fp16 compress every all-reduce, intra-node included; powersgd is torch's
    # low-rank PowerSGD with its error feedback, plain all-reduce for its first powersgd_warmup_steps steps.
    torch_hook: str = "none"
    powersgd_rank: int = 1  # PowerSGD's matrix_approximation_rank
    powersgd_warmup_steps: int = 10  # PowerSGD's start_powerSGD_iter (torch's default: 1000)
    # comm=diloco only (docs/diloco.md): nodes meet every sync_every inner steps; the pseudo-gradients travel
    # through the node leaders (inter=hierarchical) or each worker's share of the tensors over its own link
    # (inter=sharded: each worker holds 1/g of the outer state; auto: sharded on equal nodes), in
    # `fragments` staggered parts, in the background of the next inner step (overlap), and are applied by
    # outer_optim (a _partial_ torch.optim class). inter_compression then also takes fp8.
    sync_every: int = 32
    inter: str = "auto"
    fragments: int = 1
    overlap: bool = False
    overlap_steps: int = 1  # with overlap: the inner steps an exchange has to land (1..sync_every/fragments)
    outer_optim: Any = field(default_factory=lambda: dict(DEFAULT_OUTER_OPTIM))
    # ZeRO-1 inside the node (docs/memory.md): each worker of a node holds and steps 1/g of the optimizer's
    # state, and the node gathers the updated parameters (comm sharded or hierarchical); with comm=ddp, torch's
    # ZeroRedundancyOptimizer over all ranks of the job.
    shard_optimizer: bool = False
    # Every adapt_every steps (0: never), the inter-node link's rate as the job measures it, and the mode that
    # would serve it best (docs/observability.md#the-link-as-the-job-sees-it); comm hierarchical or sharded.
    adapt_every: int = 0
    # comm=adaptive only: the modes it may run, most faithful first (the first is where it starts), and a plan of
    # switches at given steps ([[after_step, mode], ...]) that replaces the measured choice (null: measure).
    # Its DiLoCo runs at comm.sync_every (0: the interval the measured link carries, chosen on entering it).
    adapt_modes: Any = field(default_factory=lambda: list(DEFAULT_ADAPT_MODES))
    # comm.adapt_every's advice (and so comm=adaptive): a less faithful mode only where it is expected
    # 1 + adapt_slack times as fast as the most faithful (1.0: twice as fast).
    adapt_slack: float = 1.0
    adapt_plan: Any = None

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.pipeline_chunk_mb * 2**20))

    def __post_init__(self) -> None:
        # The rules hybrid.attach's options share (one wording): algorithm, backends, timeout, compression.
        check_comm_options(algorithm=self.algorithm, intra_backend=self.intra_backend,
                           inter_backend=self.inter_backend, timeout_s=self.timeout_s, chunk_bytes=self.chunk_bytes,
                           inter_compression=None if self.algorithm in (DILOCO, ADAPTIVE) else self.inter_compression,
                           algorithms=COMM_ALGORITHMS, prefix="comm.", algorithm_key="comm",
                           elsewhere={codec: DILOCO for codec in CODECS if codec not in INTER_COMPRESSIONS})
        if isinstance(self.compression_check_every, bool) or not isinstance(self.compression_check_every, int) \
                or self.compression_check_every < 0:
            raise ValueError(f"comm.compression_check_every={self.compression_check_every!r} must be a whole number "
                             "of steps >= 0 (0: no check)")
        if isinstance(self.max_compression_error, bool) or not isinstance(self.max_compression_error, (int, float)) \
                or not self.max_compression_error > 0:
            raise ValueError(f"comm.max_compression_error={self.max_compression_error!r} must be a relative error > 0")
        if not self.pipeline_chunk_mb > 0:
            raise ValueError(f"comm.pipeline_chunk_mb={self.pipeline_chunk_mb} must be > 0")
        if self.algorithm == DILOCO:
            self._check_diloco()
        elif self.algorithm == ADAPTIVE:
            self._check_adaptive()
        else:
            self._refuse_diloco_keys()
            if self.adapt_plan is not None or list(self.adapt_modes) != list(DEFAULT_ADAPT_MODES):
                raise ValueError(f"comm.adapt_plan and comm.adapt_modes apply to comm=adaptive only; "
                                 f"comm={self.algorithm} keeps one mode")
        one_of("comm.torch_hook", self.torch_hook, TORCH_HOOKS)
        if self.torch_hook != "none" and self.algorithm != "ddp":
            raise ValueError(f"comm.torch_hook={self.torch_hook} registers one of torch's own hooks on plain DDP; "
                             f"comm={self.algorithm} has its own communication: use comm=ddp or torch_hook=none")
        if self.powersgd_rank < 1:
            raise ValueError(f"comm.powersgd_rank={self.powersgd_rank!r} must be >= 1")
        if self.powersgd_warmup_steps < 2:
            # torch: PowerSGD's error feedback needs at least one plain all-reduce first (start_powerSGD_iter > 1).
            raise ValueError(f"comm.powersgd_warmup_steps={self.powersgd_warmup_steps!r} must be >= 2")
        if self.shard_optimizer:
            self._check_shard_optimizer()
        if not self.bucket_mb > 0:
            raise ValueError(f"comm.bucket_mb={self.bucket_mb} must be > 0 (MiB per DDP bucket)")
        if isinstance(self.adapt_every, bool) or not isinstance(self.adapt_every, int) or self.adapt_every < 0:
            raise ValueError(f"comm.adapt_every={self.adapt_every!r} must be a whole number of steps >= 0 (0: off)")
        if isinstance(self.adapt_slack, bool) or not isinstance(self.adapt_slack, (int, float)) \
                or not self.adapt_slack >= MODE_MARGIN:
            raise ValueError(f"comm.adapt_slack={self.adapt_slack!r} must be a share >= {MODE_MARGIN} (1.0: a less "
                             "faithful mode only where it is expected twice as fast)")
        if self.adapt_every and self.algorithm not in ADAPTS:
            raise ValueError(f"comm.adapt_every={self.adapt_every} times the inter-node phase of comm "
                             f"{', '.join(ADAPTS[:-1])} or {ADAPTS[-1]}; comm={self.algorithm} has none of its own")

    def _check_shard_optimizer(self) -> None:
        if self.algorithm not in SHARDS_OPTIMIZER:
            why = {"flat": "has no intra-node phase to gather the updated parameters over",
                   "hsdp": "shards the optimizer already, with the parameters (FSDP2)"}[self.algorithm]
            raise ValueError(f"comm.shard_optimizer=true is not available with comm={self.algorithm}, which {why}: "
                             f"use comm={' or comm='.join(SHARDS_OPTIMIZER)}")
        if self.algorithm == "ddp":
            return  # torch's ZeroRedundancyOptimizer: it shards whole parameters over the job's ranks
        if not self.grad_as_bucket_view:
            raise ValueError("comm.shard_optimizer=true gathers the updated parameters through DDP's gradient "
                             "buckets: it needs comm.grad_as_bucket_view=true")

    def _check_diloco(self) -> None:
        if isinstance(self.sync_every, bool) or not self.sync_every >= 1:
            raise ValueError(f"comm.sync_every={self.sync_every!r} must be >= 1 (inner steps between syncs)")
        one_of("comm.inter", self.inter, ("auto", *INTER_MODES))
        self._check_streaming()
        self._check_outer_optim()

    def _check_streaming(self) -> None:
        """DiLoCo's streaming keys, comm=diloco's and those of comm=adaptive's DiLoCo mode: the outer exchange's wire
        dtype, and the fragments and overlap laid out over comm.sync_every (adaptive's 0, the interval the measured
        link carries, is rounded up to fit them: :func:`hybrid.app.replicas.adaptive.streamable`)."""
        one_of("comm.inter_compression", self.inter_compression, CODECS)
        if not self.sync_every:
            if self.fragments < 1:
                raise ValueError(f"comm.fragments={self.fragments!r} must be >= 1 (the DiLoCo mode's staggered parts)")
            if self.overlap_steps < 1:
                raise ValueError(f"comm.overlap_steps={self.overlap_steps!r} must be >= 1")
            return
        if not 1 <= self.fragments <= self.sync_every or self.sync_every % self.fragments:
            raise ValueError(f"comm.fragments={self.fragments!r} must divide comm.sync_every={self.sync_every} "
                             "(each fragment syncs once per interval, at its own step)")
        if not 1 <= self.overlap_steps <= self.sync_every // self.fragments:
            raise ValueError(f"comm.overlap_steps={self.overlap_steps!r} must be in 1..{self.sync_every // self.fragments}"
                             " (comm.sync_every / comm.fragments: an exchange lands before the next one leaves)")

    def _check_outer_optim(self) -> None:
        if not isinstance(self.outer_optim, dict) or "_target_" not in self.outer_optim:
            raise ValueError(f"comm.outer_optim={self.outer_optim!r} is not a config node: give "
                             "comm.outer_optim._target_ (a torch.optim class) with _partial_: true")
        if self.outer_optim.get("_partial_") is not True:
            raise ValueError(f"comm.outer_optim._partial_={self.outer_optim.get('_partial_')!r}: the outer "
                             "optimizer is built with the global weights, so its node needs _partial_: true")

    def _check_adaptive(self) -> None:
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int) or self.sync_every < 0:
            raise ValueError(f"comm.sync_every={self.sync_every!r} must be >= 1 inner steps between DiLoCo's syncs, "
                             "or 0: the interval the measured link carries")
        one_of("comm.inter", self.inter, ("auto", "hierarchical"), " (comm=adaptive's DiLoCo syncs through the "
               "node leaders, where it also probes the link)")
        # Its DiLoCo mode streams as comm=diloco does; its every-step modes name their own 16-bit hop (+bf16).
        self._check_streaming()
        modes = self.adapt_modes
        if not isinstance(modes, (list, tuple)) or not modes or len(set(modes)) != len(modes) \
                or any(m not in ADAPTIVE_MODES for m in modes):
            raise ValueError(f"comm.adapt_modes={modes!r} must list some of {', '.join(ADAPTIVE_MODES)}, each once "
                             "(most faithful first; the first is where the run starts)")
        if self.adapt_plan is None and not self.adapt_every:
            raise ValueError("comm=adaptive needs comm.adapt_every=N (measure the link every N steps) or "
                             "comm.adapt_plan=[[after_step, mode], ...]")
        for _, mode in self.plan().entries if self.adapt_plan is not None else ():
            if mode.name not in modes:
                raise ValueError(f"comm.adapt_plan names {mode}, which is not in comm.adapt_modes={list(modes)}")
        self._check_outer_optim()

    def guarded(self, compressor: InterCompressor) -> InterCompressor:
        """``compressor`` with this run's guard (comm.compression_check_every, comm.max_compression_error)."""
        compressor.guard(self.compression_check_every, self.max_compression_error)
        return compressor

    def plan(self) -> ModePlan | None:
        """comm.adapt_plan, checked (None: the modes follow the measured link)."""
        if self.adapt_plan is None:
            return None
        if not isinstance(self.adapt_plan, (list, tuple)):
            raise ValueError(f"comm.adapt_plan={self.adapt_plan!r} must be a list of [after_step, mode]")
        return ModePlan(list(self.adapt_plan))

    def _refuse_diloco_keys(self) -> None:
        """comm=diloco's keys changed under another comm: said, not silently ignored."""
        defaults = CommConfig.__dataclass_fields__
        for key in DILOCO_KEYS[:-1]:  # the outer optimizer, a node, below
            if getattr(self, key) != defaults[key].default:
                raise ValueError(f"comm.{key}={getattr(self, key)!r} applies to comm=diloco only; "
                                 f"comm={self.algorithm} does not sync in intervals")
        if self.outer_optim != DEFAULT_OUTER_OPTIM:
            raise ValueError(f"comm.outer_optim applies to comm=diloco only; comm={self.algorithm} has no outer "
                             "optimizer")


@dataclass
class DataConfig:
    """The ``data`` node: the dataset component and the loader keys that are hybrid's (not its arguments)."""

    dataset: Component
    batch_size: int = 32  # per worker, per micro-step
    num_workers: int = 0  # DataLoader worker processes per rank


@dataclass
class OptimConfig:
    """The ``optim`` node: the optimizer component (a ``_partial_`` torch.optim class, called with the
    parameters) and hybrid's LR schedule keys."""

    optimizer: Component
    warmup_steps: int = 10
    schedule: str = "cosine"  # cosine | constant (after the warm-up)
    min_lr_ratio: float = 0.1
    # Two parameter groups, as nanoGPT makes them: tensors of 2+ dimensions (matmul weights, embeddings) with the
    # optimizer's weight decay, the others (biases, norm weights) without (hybrid.app.components.optim).
    no_decay: bool = False

    @property
    def lr(self) -> Any:
        return self.optimizer.get("lr")


# hybrid's own keys of each component node, with their defaults; the rest of a node is its target's arguments.
DATA_KEYS = {"batch_size": 32, "num_workers": 0}
OPTIM_KEYS = {"warmup_steps": 10, "schedule": "cosine", "min_lr_ratio": 0.1, "no_decay": False}


@dataclass
class TrainerConfig:
    max_steps: int = 50
    seed: int = 0
    grad_accum_steps: int = 1
    checkpoint_every: int = 0  # 0: only at the end
    resume: Any = False  # false | true (this run dir) | path of an earlier run dir
    stop_after: int = 0  # >0: stop after this many steps of this invocation (checkpointed; resume later)
    log_every: int = 10
    device: str = "auto"
    num_threads: int = 0  # 0: share the machine's cores among its workers
    keep_checkpoints: int = 3  # the newest K checkpoints are kept; a corrupt newest one falls back to the next
    check_replicas_every: int = 0  # >0: every N steps compare parameter checksums across ranks; stop on a mismatch
    nonfinite_grads: str = "stop"  # stop | skip: what a step with inf/NaN (averaged) gradients does
    precision: str = "fp32"  # fp32 | bf16: forward and loss under autocast; weights and averaged gradients stay fp32
    grad_clip_norm: float = 0.0  # >0: clip the averaged gradients to this global L2 norm (alike on every rank)
    # When a resume changes the global batch (another world size; or data.batch_size / grad_accum_steps): keep
    # the learning rate, or scale it by new / old global batch (the linear scaling rule).
    elastic_lr: str = "keep"
    # timeline.json in the run dir (Chrome trace: Perfetto, chrome://tracing): every rank's loop parts and
    # communication phases for steps timeline_steps = [first, last] (1-based, both included).
    timeline: bool = False
    timeline_steps: Any = field(default_factory=lambda: [3, 5])
    # A node whose compute (data, forward, backward, optimizer) takes more than (1 + straggler_margin) x the
    # other nodes' median is the one they wait for: metrics.json names it slowest_node, and straggler_steps
    # such steps in a row print a warning.
    straggler_margin: float = 0.25
    straggler_steps: int = 5
    # torch.compile the DDP model (process mode, every comm that runs DDP); the first step pays the compile.
    compile: bool = False

    @property
    def timeline_window(self) -> tuple[int, int]:
        """``timeline_steps`` as (first, last); ValueError in one line where it is not two steps in order."""
        steps = self.timeline_steps
        if (not isinstance(steps, (list, tuple)) or len(steps) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
                or not 1 <= steps[0] <= steps[1]):
            raise ValueError(f"trainer.timeline_steps={steps!r} must be [first, last]: steps, 1 <= first <= last")
        return steps[0], steps[1]


@dataclass
class TrainSchema:
    """What Hydra composes and type-checks (registered as ``train_schema``). The pluggable parts are open
    ``_target_`` nodes (any arguments); :func:`validate` turns the whole into a :class:`TrainConfig`."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    model: Any = field(default_factory=dict)
    data: Any = field(default_factory=lambda: dict(DATA_KEYS))
    loss: Any = field(default_factory=dict)
    optim: Any = field(default_factory=lambda: dict(OPTIM_KEYS))
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class TrainConfig:
    """The validated settings of a run: what the trainer, the launchers and the tools receive."""

    cluster: ClusterConfig
    comm: CommConfig
    model: Component
    data: DataConfig
    loss: Component
    optim: OptimConfig
    trainer: TrainerConfig

    @property
    def layout(self) -> Layout:
        return Layout.uniform(self.cluster.nnodes, self.cluster.nproc_per_node)

    @property
    def process_layout(self) -> Layout:
        """The processes a launch starts: one per device, or one per node with ``cluster.intra_mode=thread``."""
        per_node = 1 if self.cluster.intra_mode == "thread" else self.cluster.nproc_per_node
        return Layout.uniform(self.cluster.nnodes, per_node)


def outer_optimizer(comm: CommConfig) -> Component:
    """comm=diloco's outer optimizer node as a component (built with the global weights)."""
    component, _ = component_of("comm.outer_optim", comm.outer_optim)
    return component


def packaged_conf_dir() -> Path:
    """Where the shipped configs are on disk (the repository's conf/ in an editable install)."""
    return Path(str(importlib.resources.files(CONF_PACKAGE)))


def _at_least(key: str, value: Any, low: float) -> None:
    if not value >= low:
        raise ValueError(f"{key}={value!r} must be >= {low:g}")


def resume_continues_this_run(value: Any) -> bool:
    """``trainer.resume=true``: continue the run in this run dir (not a path to another one)."""
    return value is True or str(value).lower() in ("true", "yes")


def resume_target(value: Any, run_dir: Path) -> Path | None:
    """``trainer.resume`` as a run directory: None (fresh), this run dir (true) or a given path."""
    if value is None or value is False or str(value).lower() in ("false", "", "none", "no"):
        return None
    if resume_continues_this_run(value):
        return run_dir
    return Path(str(value)).expanduser().resolve()


def validate(cfg: TrainSchema) -> TrainConfig:
    """Range and choice checks, and the split of each component node into its target and hybrid's keys;
    raises ValueError with one line naming key, value and rule. Components are built (and so checked
    further) by :func:`hybrid.app.checks.prepare`."""
    _validate_cluster(cfg.cluster)
    cfg.comm.__post_init__()  # algorithm, backends, bucket size, timeout
    _validate_recovery(cfg.cluster, cfg.comm.algorithm)
    if cfg.cluster.recovery == IN_PLACE and cfg.comm.shard_optimizer and cfg.comm.algorithm == "ddp":
        raise ValueError(IN_PLACE_REFUSALS["ddp+shard_optimizer"])
    if cfg.cluster.intra_mode == "thread" and cfg.comm.algorithm != "hierarchical":
        raise ValueError(
            f"comm={cfg.comm.algorithm} is not available with cluster.intra_mode=thread, which is hierarchical by "
            "construction (reduce inside the node process, all-reduce among node processes): use comm=hierarchical"
        )
    if cfg.comm.adapt_every and (cfg.cluster.nnodes < 2 or cfg.cluster.intra_mode != "process"):
        raise ValueError(f"comm.adapt_every={cfg.comm.adapt_every} measures the link between nodes in process mode: "
                         f"cluster.nnodes={cfg.cluster.nnodes} must be >= 2 with cluster.intra_mode=process")
    if cfg.cluster.intra_mode == "thread" and cfg.comm.torch_hook != "none":
        raise ValueError(f"comm.torch_hook={cfg.comm.torch_hook} hooks torch DDP, which cluster.intra_mode=thread "
                         "does not run: use cluster.intra_mode=process")
    if cfg.trainer.compile:
        _check_compile(cfg)
    if cfg.cluster.intra_mode == "thread" and cfg.comm.shard_optimizer:
        raise ValueError("comm.shard_optimizer=true shards the optimizer over a node's worker processes; "
                         "cluster.intra_mode=thread runs one process per node: use cluster.intra_mode=process")
    model, _ = component_of("model", cfg.model)
    dataset, loader = component_of("data", cfg.data, DATA_KEYS)
    data = DataConfig(_with_input_kind(dataset, model), **loader)
    loss, _ = component_of("loss", cfg.loss)
    optimizer, schedule = component_of("optim", cfg.optim, OPTIM_KEYS)
    optim = OptimConfig(optimizer, **schedule)
    if optimizer.get("_partial_") is not True:
        raise ValueError(f"optim._partial_={optimizer.get('_partial_')!r}: an optimizer is built with the model's "
                         "parameters, so its node needs _partial_: true")
    _validate_loader(data)
    _validate_schedule(optim)
    _validate_trainer(cfg.trainer)
    return TrainConfig(cfg.cluster, cfg.comm, model, data, loss, optim, cfg.trainer)


def _check_compile(cfg: TrainSchema) -> None:
    """trainer.compile: torch.compile'd DDP, where DDP runs with buckets torch's compiler can split the graph at."""
    if not isinstance(cfg.trainer.compile, bool):
        raise ValueError(f"trainer.compile={cfg.trainer.compile!r} must be true or false")
    if cfg.cluster.intra_mode == "thread":
        raise ValueError("trainer.compile=true compiles the DDP model of each worker process; cluster.intra_mode=thread "
                         "runs no DDP (one process drives a node's replicas from threads): use cluster.intra_mode=process")
    if cfg.comm.algorithm == "hsdp":
        raise ValueError("trainer.compile=true compiles the DDP model; comm=hsdp runs torch FSDP2, not DDP: use a comm "
                         "that runs DDP (ddp, flat, hierarchical, sharded, auto, diloco, adaptive)")
    if cfg.comm.bucket_mb < 1:
        raise ValueError(f"trainer.compile=true: torch's DDPOptimizer splits the compiled graph at DDP's buckets, which "
                         f"must be at least DDP's first bucket (1 MiB): comm.bucket_mb={cfg.comm.bucket_mb} must be >= 1")


def _validate_recovery(c: ClusterConfig, comm: str) -> None:
    one_of("cluster.recovery", c.recovery, RECOVERY_MODES)
    if c.recovery != IN_PLACE:
        return
    if not 0 < c.min_nnodes < c.nnodes:
        raise ValueError(f"cluster.recovery=in_place needs an elastic job: cluster.min_nnodes={c.min_nnodes} must be "
                         f"in 1..{c.nnodes - 1} (below cluster.nnodes={c.nnodes})")
    if comm in IN_PLACE_REFUSALS:
        raise ValueError(IN_PLACE_REFUSALS[comm])


# What cluster.recovery=in_place refuses, and why (docs/compatibility.md's table is held to these).
IN_PLACE_REFUSALS = {
    "ddp+shard_optimizer": "cluster.recovery=in_place is not available with comm=ddp and comm.shard_optimizer=true: "
                           "torch's ZeroRedundancyOptimizer shards the optimizer over every rank of the job, so a "
                           "lost node takes shards no survivor holds; use comm=sharded or comm=hierarchical, which "
                           "shard inside the node (every node holds every shard), or cluster.recovery=restart",
}


def _validate_etcd(c: ClusterConfig) -> None:
    """cluster.rdzv_endpoint names etcd members (or is empty: the launcher starts them), and etcd can be used."""
    from hybrid.runtime.etcd_cluster import etcd_client_missing, etcd_missing
    from hybrid.runtime.etcd_store import members_of

    if c.rdzv_endpoint:
        try:
            members_of(c.rdzv_endpoint)
        except ValueError as exc:
            raise ValueError(f"cluster.rdzv_endpoint={c.rdzv_endpoint!r}: {exc} (cluster.rdzv_backend=etcd: the "
                             "members, H1:P1,H2:P2,...)") from None
        if c.testbed.enabled:
            raise ValueError(f"cluster.rdzv_endpoint={c.rdzv_endpoint!r} cannot be reached from the testbed's "
                             "namespaces, which start their own etcd cluster: leave it empty")
    missing = etcd_client_missing() if c.rdzv_endpoint else etcd_missing()
    if missing:
        raise ValueError(missing)


def _validate_cluster(c: ClusterConfig) -> None:
    _at_least("cluster.nnodes", c.nnodes, 1)
    _at_least("cluster.nproc_per_node", c.nproc_per_node, 1)
    _at_least("cluster.launch_timeout_s", c.launch_timeout_s, 1)
    _at_least("cluster.max_restarts", c.max_restarts, -1)
    if not 0 <= c.rdzv_port <= 65535:
        raise ValueError(f"cluster.rdzv_port={c.rdzv_port!r} must be 0 (derived from the Slurm job id) "
                         "or a port, 1-65535")
    one_of("cluster.intra_mode", c.intra_mode, INTRA_MODES)
    one_of("cluster.rdzv_backend", c.rdzv_backend, RDZV_BACKENDS)
    if c.rdzv_backend == "etcd":
        _validate_etcd(c)
    elif c.rdzv_endpoint:
        host, _, port = c.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"cluster.rdzv_endpoint={c.rdzv_endpoint!r} must be HOST:PORT (a port 1-65535), or "
                             "empty for node 0's")
        if c.testbed.enabled:
            raise ValueError(f"cluster.rdzv_endpoint={c.rdzv_endpoint!r} cannot be reached from the testbed's "
                             "namespaces, which run their own store off the nodes: leave it empty")
    if not 0 <= c.min_nnodes <= c.nnodes:
        raise ValueError(f"cluster.min_nnodes={c.min_nnodes!r} must be in 1..cluster.nnodes={c.nnodes} "
                         "(0: all nodes are needed)")
    if 0 < c.min_nnodes < c.nnodes and c.restarts < 1:
        raise ValueError(f"cluster.min_nnodes={c.min_nnodes} < cluster.nnodes={c.nnodes} needs cluster.max_restarts "
                         ">= 1: the nodes left restart their workers on the smaller membership")
    _at_least("cluster.rdzv_last_call_s", c.rdzv_last_call_s, 1)
    try:
        c.testbed.rates(c.nnodes)
    except ValueError as exc:
        raise ValueError(f"cluster.testbed.link_mbit={exc}") from None
    if not 1 <= c.testbed.nics_per_node <= MAX_NICS:
        raise ValueError(f"cluster.testbed.nics_per_node={c.testbed.nics_per_node!r} must be in 1..{MAX_NICS}")
    _at_least("cluster.testbed.burst_kb", c.testbed.burst_kb, 0)
    _at_least("cluster.testbed.latency_ms", c.testbed.latency_ms, 0.001)
    try:
        c.testbed.cpus(c.nnodes)
    except ValueError as exc:
        raise ValueError(f"cluster.testbed.cpu_quota={exc}") from None
    c.testbed.schedule(c.nnodes)
    if c.testbed.link_schedule is not None and not c.testbed.enabled:
        raise ValueError("cluster.testbed.link_schedule needs cluster.testbed.enabled=true: it reshapes the "
                         "testbed's links")


def check_pairing(model_target: Any, data_target: Any, data_kind: Any) -> None:
    """Refuse a built-in dataset that a built-in model cannot train on. Needs only the two ``_target_`` and
    ``data.kind``, so it runs before interpolations are resolved (mlp's ``${data.features}`` on text data
    would otherwise be the first error)."""
    model_target, data_target = current_target(model_target), current_target(data_target)
    takes = INPUT_KIND.get(model_target)
    kind = TEXT_KIND if data_target == TEXT_TARGET else data_kind
    if takes is None or kind in (None, "auto", "any") or kind == takes:
        return
    label = label_of(str(model_target))
    if data_target == TEXT_TARGET:
        language = " or ".join(f"model={label_of(t)}" for t, k in INPUT_KIND.items() if k == TEXT_KIND)
        raise ValueError(f"data=text is next-byte prediction for a language model: model={label} cannot train on "
                         f"it; use {language}")
    raise ValueError(f"data.kind={kind} but model={label} takes {takes}: use data.kind=auto or {takes}")


def _with_input_kind(dataset: Component, model: Component) -> Component:
    """Resolve a built-in dataset's ``kind: auto`` to what a built-in model takes (a user's model: ``any``,
    no shape checks; data=synthetic must then be told what to generate)."""
    check_pairing(model.target, dataset.target, dataset.get("kind"))
    if dataset.get("kind") != "auto":
        return dataset
    takes = INPUT_KIND.get(model.target)
    if takes is None and dataset.target == SYNTHETIC_TARGET:
        raise ValueError(f"data.kind=auto generates inputs for hybrid's built-in models; "
                         f"model._target_={model.target} is not one: give data.kind=vectors|images|tokens")
    return replace(dataset, args={**dataset.args, "kind": takes or "any"})


def _validate_loader(d: DataConfig) -> None:
    _at_least("data.batch_size", d.batch_size, 1)
    _at_least("data.num_workers", d.num_workers, 0)


def _validate_schedule(o: OptimConfig) -> None:
    one_of("optim.schedule", o.schedule, SCHEDULES)
    _at_least("optim.warmup_steps", o.warmup_steps, 0)
    if not 0 <= o.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={o.min_lr_ratio!r} must be in [0, 1]")


def _validate_trainer(t: TrainerConfig) -> None:
    _at_least("trainer.max_steps", t.max_steps, 1)
    _at_least("trainer.grad_accum_steps", t.grad_accum_steps, 1)
    _at_least("trainer.checkpoint_every", t.checkpoint_every, 0)
    _at_least("trainer.stop_after", t.stop_after, 0)
    _at_least("trainer.log_every", t.log_every, 1)
    _at_least("trainer.num_threads", t.num_threads, 0)
    one_of("trainer.device", t.device, DEVICES)
    _at_least("trainer.keep_checkpoints", t.keep_checkpoints, 1)
    _at_least("trainer.check_replicas_every", t.check_replicas_every, 0)
    one_of("trainer.nonfinite_grads", t.nonfinite_grads, NONFINITE_ACTIONS)
    one_of("trainer.precision", t.precision, PRECISIONS)
    _at_least("trainer.grad_clip_norm", t.grad_clip_norm, 0)
    one_of("trainer.elastic_lr", t.elastic_lr, ELASTIC_LR)
    t.timeline_window  # noqa: B018 (validates)
    _at_least("trainer.straggler_margin", t.straggler_margin, 0)
    _at_least("trainer.straggler_steps", t.straggler_steps, 1)
