"""Usable from any training loop: who is where (``topology``, ``nodes``), how gradients travel (``comm``: the
algorithms, their groups and ordered stream, the DDP hook, compression), what it costs (``costmodel``),
``hybrid.attach`` / ``hybrid.connect`` (``attach``), the optimizer sharded inside each node
(``node_sharded_optimizer``, ``optimizer_shards``), DiLoCo's outer loop and its pseudo-gradients' encoding
(``diloco``), where a step's time goes (``clock``, ``timeline``), placeholder tensors
that cost no memory (``untouched``) and sizes and rates in words (``units``). Imports neither Hydra nor
TensorBoard, and nothing above it."""
