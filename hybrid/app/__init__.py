"""The Hydra trainer. Its top level runs a job: ``train`` (the Hydra entry point), ``checks`` (every one-line
refusal before anything starts), ``worker`` (one rank's set-up and training, process, thread or HSDP mode),
``setup`` and ``loop`` (state built and stepped), ``config`` (typed settings) and ``targets`` (the ``_target_``
split). Its sub-packages hold the parts, each importing only from those listed before it:
``components`` (models, data, losses, optimizers) <- ``state`` (checkpoints, membership, error feedback) <-
``replicas`` (how replicas sync) <- ``observability`` (metrics, step accounts, timeline).
Imports :mod:`hybrid.runtime` and :mod:`hybrid.core`."""
