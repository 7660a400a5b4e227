"""Usable from any training loop: who is where (topology), how gradients travel (comm), what it costs
(costmodel). Imports neither Hydra nor TensorBoard, and nothing above it."""
