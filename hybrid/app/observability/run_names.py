"""What runs are called: the OmegaConf resolvers that name run directories, and so TensorBoard's runs.

TensorBoard names a run by its directory under ``--logdir``, so the directory
names are what a user reads in the Scalars tab. ``conf/config.yaml`` names

- a single run ``outputs/runs/<date>_<time>_<comm>_<nodes>x<workers>``
  (``hybrid.layout`` gives the layout that runs: torchrun's under torchrun);
- a sweep's job ``<sweep dir>/<job number>_<its overrides>``, e.g.
  ``03_cluster:2x4+comm:hierarchical`` (``hybrid.sweep_job``): the overrides
  tell the jobs apart, the number, padded to two digits, keeps names unique
  and in launch order. Not Hydra's ``cluster=2x4,comm=hierarchical``: ``=``
  and ``,`` are Hydra's override syntax, and a job's directory is passed back
  as an override value (``trainer.resume=<job dir>``); these names pass
  unquoted, in a shell too.

The resolvers are registered when :mod:`hybrid.app.train` is imported, before
Hydra resolves ``hydra.run.dir`` or ``hydra.sweep.subdir``.
"""

from __future__ import annotations

import os
import re

from omegaconf import OmegaConf

__all__ = ["MAX_NAME_BYTES", "layout_name", "register_resolvers", "sweep_job_name"]

# File systems allow 255 bytes per name; what is cut is the end of a long override list (the number stays unique).
MAX_NAME_BYTES = 200
_UNSAFE = re.compile(r"[^A-Za-z0-9._+:@%-]")


def sweep_job_name(num: int | str, overrides: str) -> str:
    """A sweep job's directory: its number (two digits at least, so 12 jobs sort 00..11) and Hydra's
    ``override_dirname`` (``key:value`` sorted, joined by ``+``, as conf/config.yaml sets it). Any other
    character becomes ``_``: a ``/`` in a value (a path), so a job stays one directory and one TensorBoard
    run, and what Hydra's grammar or a shell would read (``[1,0.25]``, quotes, spaces, ``*``, ``$``)."""
    name = f"{int(num):02d}"
    if overrides:
        name += "_" + _UNSAFE.sub("_", overrides)
    return name.encode()[:MAX_NAME_BYTES].decode(errors="ignore")


def layout_name(nnodes: int | str, nproc_per_node: int | str) -> str:
    """``<nodes>x<workers per node>``: the config's, or torchrun's where it runs this (its layout wins unless
    ``cluster.*`` is overridden, and then the two must agree: :func:`hybrid.app.checks.check_torchrun_layout`)."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        nnodes = os.environ.get("GROUP_WORLD_SIZE", nnodes)
        nproc_per_node = os.environ.get("LOCAL_WORLD_SIZE", nproc_per_node)
    return f"{nnodes}x{nproc_per_node}"


def register_resolvers() -> None:
    """``hybrid.sweep_job`` and ``hybrid.layout``, once per process."""
    for name, resolver in (("hybrid.sweep_job", sweep_job_name), ("hybrid.layout", layout_name)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
