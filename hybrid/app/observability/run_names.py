"""What runs are called: the OmegaConf resolvers that name run directories, and so TensorBoard's runs.

TensorBoard names a run by its directory under ``--logdir``, so the directory
names are what a user reads in the Scalars tab. ``conf/config.yaml`` names

- a single run ``outputs/runs/<date>_<time>_<comm>_<nodes>x<workers>``
  (``hybrid.layout`` gives the layout that runs: torchrun's under torchrun);
- a sweep's job ``<sweep dir>/<job number>_<what it sweeps>``, e.g.
  ``03_cluster:2x4+comm:hierarchical`` (``hybrid.sweep_job``): the values of
  the keys the sweep varies tell the jobs apart (an override every job shares,
  ``cluster.testbed.enabled=true``, would only lengthen every name; the
  sweep's ``multirun.yaml``, written before its first job, says which vary, as
  Hydra's own parser reads it); the number, padded to two digits, keeps names
  unique and in launch order. Not Hydra's ``cluster=2x4,comm=hierarchical``:
  ``=`` and ``,`` are Hydra's override syntax, and a job's directory is passed
  back as an override value (``trainer.resume=<job dir>``); these names pass
  unquoted, in a shell too.

The resolvers are registered when :mod:`hybrid.app.train` is imported, before
Hydra resolves ``hydra.run.dir`` or ``hydra.sweep.subdir``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

__all__ = ["MAX_NAME_BYTES", "layout_name", "register_resolvers", "swept_keys", "sweep_job_name"]

# File systems allow 255 bytes per name; what is cut is the end of a long override list (the number stays unique).
MAX_NAME_BYTES = 200
_UNSAFE = re.compile(r"[^A-Za-z0-9._+:@%-]")


def sweep_job_name(num: int | str, overrides: Sequence[str], sweep_dir: str | None = None) -> str:
    """A sweep job's directory: its number (two digits at least, so 12 jobs sort 00..11) and its overrides
    (``hydra.overrides.task``) as ``key:value`` joined by ``+``, only those of keys the sweep varies where
    ``sweep_dir``'s ``multirun.yaml`` says which (:func:`swept_keys`), else all but ``experiment``. Any other
    character becomes ``_``: a ``/`` in a value (a path), so a job stays one directory and one TensorBoard
    run, and what Hydra's grammar or a shell would read (``[1,0.25]``, quotes, spaces, ``*``, ``$``)."""
    varying = swept_keys(Path(sweep_dir) / "multirun.yaml") if sweep_dir else set()
    items = []
    for override in overrides:
        key, _, value = str(override).partition("=")
        bare = key.lstrip("+~")
        if (bare in varying) if varying else bare != "experiment":
            items.append(f"{bare}:{value}")  # +peer=ddp: peer:ddp (a leading + would read as a separator)
    name = f"{int(num):02d}"
    if items:
        name += "_" + _UNSAFE.sub("_", "+".join(items))
    return name.encode()[:MAX_NAME_BYTES].decode(errors="ignore")


def swept_keys(multirun_yaml: Path) -> set[str]:
    """The keys a sweep varies, from its ``multirun.yaml``: the command line's sweep overrides
    (``comm=flat,hierarchical``) and the config's ``hydra.sweeper.params`` with more than one value, parsed by
    Hydra's override parser; empty if the file cannot be read."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        sweep = OmegaConf.load(multirun_yaml).hydra
        given = [str(o) for o in sweep.overrides.task]
        params = sweep.sweeper.get("params")
        given += [f"{key}={value}" for key, value in (params.items() if params else ())]
        parsed = OverridesParser.create().parse_overrides(given)
    except Exception:  # no file yet, or one this version cannot read: every override names the job
        return set()
    return {o.key_or_group.lstrip("+~") for o in parsed if o.is_sweep_override()}


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
