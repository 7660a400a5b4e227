"""The Hydra trainer: typed config and its one-line checks, per-rank set-up, the training loop, data,
models, optimizers, checkpoints and metrics. Imports :mod:`hybrid.runtime` and :mod:`hybrid.core`."""
