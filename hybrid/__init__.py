"""hybrid: data-parallel PyTorch training with a two-level (intra-node / inter-node) gradient communicator.

Four layers, imports only downward (tools -> app -> runtime -> core; tests/test_layers.py enforces it):

- :mod:`hybrid.core`: topology, the communicators and their DDP hook, the cost model. Usable from any
  training loop; imports neither Hydra nor TensorBoard.
- :mod:`hybrid.runtime`: processes and networks: joining the process group, torch elastic launches,
  the network-namespace testbed, Slurm tasks.
- :mod:`hybrid.app`: the Hydra trainer: typed config, start-up checks, set-up, the training loop.
- :mod:`hybrid.tools`: benchmarks, the sweep report, the cost model's command line.

``python -m hybrid.train|bench|report|costmodel`` are thin entry points onto these.
"""
