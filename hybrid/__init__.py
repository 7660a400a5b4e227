"""hybrid: data-parallel PyTorch training with a two-level (intra-node / inter-node) gradient communicator.

Five layers, imports only downward (tools -> app -> integrations -> runtime -> core; tests/test_layers.py
enforces it):

- :mod:`hybrid.core`: topology, the communicators and their DDP hook, ``attach``, the cost model. Usable
  from any training loop; imports neither Hydra nor TensorBoard.
- :mod:`hybrid.runtime`: processes and networks: joining the process group, torch elastic launches,
  the network-namespace testbed, Slurm tasks.
- :mod:`hybrid.integrations`: the communicator inside Lightning and the Hugging Face Trainer.
- :mod:`hybrid.app`: the Hydra trainer: typed config, start-up checks, set-up, the training loop.
- :mod:`hybrid.tools`: benchmarks, the sweep report, the cost model's command line.

``python -m hybrid.train|bench|report|costmodel`` are thin entry points onto these.

For any DDP program, whoever launched it: ``hybrid.attach(ddp_model, algorithm="hierarchical")``
(:func:`hybrid.core.attach.attach`; ``hybrid.connect`` builds the communicator before the model exists;
``hybrid.connect("sharded").shard_optimizer(ddp_model, optimizer)`` shards the optimizer inside each node).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports these on first use
    from hybrid.core.attach import Attached, CommOptions, NodeShardedOptimizer, attach, connect

__all__ = ["Attached", "CommOptions", "NodeShardedOptimizer", "attach", "connect"]


def __getattr__(name: str) -> Any:
    # Imported on first use: ``import hybrid`` (every ``python -m hybrid.*``) stays free of torch.
    if name in __all__:
        from hybrid.core import attach as _attach

        value = getattr(_attach, name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module 'hybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
