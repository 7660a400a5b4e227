"""Typed settings of a training run.

These dataclasses are the schema Hydra validates every config and override
against (registered in :mod:`hybrid.app.train`), and, once composed, the plain
objects (``OmegaConf.to_object``) the trainer receives: no DictConfig crosses
into the training code, and this module does not import Hydra.

:func:`validate` adds the checks a type cannot express (ranges, choices,
files that must exist), each failing with one line that names the key, the
bad value and what is allowed.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybrid.core.comm.compression import INTER_COMPRESSIONS
from hybrid.core.comm.groups import BACKENDS
from hybrid.core.comm.registry import CHOOSABLE, COMPRESSIBLE
from hybrid.core.topology import Layout

__all__ = [
    "COMM_ALGORITHMS",
    "CONF_PACKAGE",
    "ClusterConfig",
    "CommConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "TestbedConfig",
    "TrainerConfig",
    "packaged_conf_dir",
    "resume_continues_this_run",
    "resume_target",
    "validate",
]

# The repository's conf/, installed inside the package as hybrid.conf (pyproject.toml maps it), so a wheel
# carries its configs and Hydra finds them from any directory.
CONF_PACKAGE = "hybrid.conf"

MODELS = ("mlp", "cnn", "transformer")
DATASETS = ("synthetic", "files")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")
NONFINITE_ACTIONS = ("stop", "skip")
PRECISIONS = ("fp32", "bf16")
INTRA_MODES = ("process", "thread")


@dataclass
class TestbedConfig:
    """Run each simulated node in its own network namespace behind a shaped link (hybrid.runtime.testbed)."""

    enabled: bool = False
    link_mbit: float = 500.0  # each node's NIC, both directions
    burst_kb: float = 0.0  # tbf burst; 0 = one 4 ms tick at the rate, at least 64 KB
    latency_ms: float = 50.0  # tbf queue limit


@dataclass
class ClusterConfig:
    nnodes: int = 2
    nproc_per_node: int = 2
    launch_timeout_s: float = 3600.0  # whole-job deadline of a local launch
    max_restarts: int = 0  # elastic restarts of a node's workers after a failure; they resume from the last checkpoint
    # process: one process per device; thread: one process per node drives its nproc_per_node devices
    # (nn.DataParallel-style replicas in threads; hybrid.app.node_parallel)
    intra_mode: str = "process"
    # hydra/launcher=slurm: the rendezvous port on the job's first host (firewalled sites); 0: derived from
    # the Slurm job id (20000-31999), so concurrent jobs sharing a first host rarely meet on one port
    rdzv_port: int = 0
    testbed: TestbedConfig = field(default_factory=TestbedConfig)


# "ddp" is torch DDP's own all-reduce (no hook): the reference every algorithm is checked against;
# "auto" picks flat, hierarchical or sharded per bucket size from a cost model calibrated at start-up.
COMM_ALGORITHMS = (*CHOOSABLE, "ddp")


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

    @property
    def chunk_bytes(self) -> int:
        return max(1, int(self.pipeline_chunk_mb * 2**20))

    def __post_init__(self) -> None:
        if self.algorithm not in COMM_ALGORITHMS:
            raise ValueError(f"comm.algorithm={self.algorithm!r} is not one of {', '.join(COMM_ALGORITHMS)}")
        for level in ("intra", "inter"):
            value = getattr(self, f"{level}_backend")
            if value not in BACKENDS:
                raise ValueError(f"comm.{level}_backend={value!r} is not one of {', '.join(BACKENDS)}")
        if self.inter_compression not in INTER_COMPRESSIONS:
            raise ValueError(f"comm.inter_compression={self.inter_compression!r} is not one of "
                             f"{', '.join(INTER_COMPRESSIONS)}")
        if self.inter_compression != "none" and self.algorithm not in COMPRESSIBLE:
            raise ValueError(f"comm.inter_compression={self.inter_compression!r} compresses the inter-node phase of "
                             f"hierarchical and sharded (and auto's choices of them); comm={self.algorithm} has "
                             "none: use none")
        if not self.bucket_mb > 0:
            raise ValueError(f"comm.bucket_mb={self.bucket_mb} must be > 0 (MiB per DDP bucket)")
        if not self.pipeline_chunk_mb > 0:
            raise ValueError(f"comm.pipeline_chunk_mb={self.pipeline_chunk_mb} must be > 0")
        if not self.timeout_s > 0:
            raise ValueError(f"comm.timeout_s={self.timeout_s} must be > 0 seconds")


@dataclass
class ModelConfig:
    name: str = "mlp"
    width: int = 256  # hidden size (MLP, CNN head), d_model (transformer)
    depth: int = 4  # hidden layers (MLP), conv blocks (CNN), transformer blocks
    channels: int = 16  # CNN: channels of the first conv block
    heads: int = 4  # transformer attention heads


@dataclass
class DataConfig:
    name: str = "synthetic"
    root: str = "data"  # where synthetic datasets are generated once and reused
    inputs: str = ""  # name=files: a .npy or .pt file of inputs (.pt may hold both)
    targets: str = ""  # name=files: a .npy or .pt file of targets
    num_samples: int = 8192
    features: int = 64  # MLP input size
    classes: int = 10
    image_size: int = 16  # CNN inputs are 1 x image_size x image_size
    vocab_size: int = 256  # transformer
    seq_len: int = 64  # transformer
    batch_size: int = 32  # per worker, per micro-step
    num_workers: int = 0  # DataLoader worker processes per rank
    seed: int = 1234  # synthetic data generation


@dataclass
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 10
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1


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


@dataclass
class TrainConfig:
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def layout(self) -> Layout:
        return Layout.uniform(self.cluster.nnodes, self.cluster.nproc_per_node)

    @property
    def process_layout(self) -> Layout:
        """The processes a launch starts: one per device, or one per node with ``cluster.intra_mode=thread``."""
        per_node = 1 if self.cluster.intra_mode == "thread" else self.cluster.nproc_per_node
        return Layout.uniform(self.cluster.nnodes, per_node)



def packaged_conf_dir() -> Path:
    """Where the shipped configs are on disk (the repository's conf/ in an editable install)."""
    return Path(str(importlib.resources.files(CONF_PACKAGE)))


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {', '.join(allowed)}")


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


def validate(cfg: TrainConfig) -> TrainConfig:
    """Range and choice checks; raises ValueError with one line naming key, value and rule."""
    _at_least("cluster.nnodes", cfg.cluster.nnodes, 1)
    _at_least("cluster.nproc_per_node", cfg.cluster.nproc_per_node, 1)
    _at_least("cluster.launch_timeout_s", cfg.cluster.launch_timeout_s, 1)
    _at_least("cluster.max_restarts", cfg.cluster.max_restarts, 0)
    if not 0 <= cfg.cluster.rdzv_port <= 65535:
        raise ValueError(f"cluster.rdzv_port={cfg.cluster.rdzv_port!r} must be 0 (derived from the Slurm job id) "
                         "or a port, 1-65535")
    _one_of("cluster.intra_mode", cfg.cluster.intra_mode, INTRA_MODES)
    if not cfg.cluster.testbed.link_mbit > 0:
        raise ValueError(f"cluster.testbed.link_mbit={cfg.cluster.testbed.link_mbit!r} must be > 0")
    _at_least("cluster.testbed.burst_kb", cfg.cluster.testbed.burst_kb, 0)
    _at_least("cluster.testbed.latency_ms", cfg.cluster.testbed.latency_ms, 0.001)
    cfg.comm.__post_init__()  # algorithm, backends, bucket size, timeout
    if cfg.cluster.intra_mode == "thread" and cfg.comm.algorithm != "hierarchical":
        raise ValueError(
            f"comm={cfg.comm.algorithm} is not available with cluster.intra_mode=thread, which is hierarchical by "
            "construction (reduce inside the node process, all-reduce among node processes): use comm=hierarchical"
        )
    _one_of("model.name", cfg.model.name, MODELS)
    for key in ("width", "depth", "channels", "heads"):
        _at_least(f"model.{key}", getattr(cfg.model, key), 1)
    if cfg.model.name == "transformer" and cfg.model.width % cfg.model.heads:
        raise ValueError(
            f"model.width={cfg.model.width} must be divisible by model.heads={cfg.model.heads}"
        )
    _one_of("data.name", cfg.data.name, DATASETS)
    for key in ("num_samples", "features", "classes", "image_size", "vocab_size", "seq_len", "batch_size"):
        _at_least(f"data.{key}", getattr(cfg.data, key), 1)
    _at_least("data.num_workers", cfg.data.num_workers, 0)
    if cfg.data.name == "files":
        if not cfg.data.inputs:
            raise ValueError("data.inputs is empty: data=files needs a .npy or .pt file of inputs")
        for key in ("inputs", "targets"):
            path = getattr(cfg.data, key)
            if path and not Path(path).expanduser().is_file():
                raise ValueError(f"data.{key}={path!r} does not exist or is not a file")
    _one_of("optim.name", cfg.optim.name, OPTIMIZERS)
    _one_of("optim.schedule", cfg.optim.schedule, SCHEDULES)
    if not cfg.optim.lr > 0:
        raise ValueError(f"optim.lr={cfg.optim.lr!r} must be > 0")
    _at_least("optim.momentum", cfg.optim.momentum, 0)
    _at_least("optim.weight_decay", cfg.optim.weight_decay, 0)
    _at_least("optim.warmup_steps", cfg.optim.warmup_steps, 0)
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ValueError(f"optim.min_lr_ratio={cfg.optim.min_lr_ratio!r} must be in [0, 1]")
    _at_least("trainer.max_steps", cfg.trainer.max_steps, 1)
    _at_least("trainer.grad_accum_steps", cfg.trainer.grad_accum_steps, 1)
    _at_least("trainer.checkpoint_every", cfg.trainer.checkpoint_every, 0)
    _at_least("trainer.stop_after", cfg.trainer.stop_after, 0)
    _at_least("trainer.log_every", cfg.trainer.log_every, 1)
    _at_least("trainer.num_threads", cfg.trainer.num_threads, 0)
    _one_of("trainer.device", cfg.trainer.device, DEVICES)
    _at_least("trainer.keep_checkpoints", cfg.trainer.keep_checkpoints, 1)
    _at_least("trainer.check_replicas_every", cfg.trainer.check_replicas_every, 0)
    _one_of("trainer.nonfinite_grads", cfg.trainer.nonfinite_grads, NONFINITE_ACTIONS)
    _one_of("trainer.precision", cfg.trainer.precision, PRECISIONS)
    _at_least("trainer.grad_clip_norm", cfg.trainer.grad_clip_norm, 0)
    return cfg
