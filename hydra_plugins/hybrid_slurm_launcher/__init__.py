"""hybrid's submitit launchers (see :mod:`hybrid.app.slurm_launcher`), where Hydra looks for launchers.

Hydra instantiates a launcher only from the ``hydra_plugins`` namespace and
imports every module in it at start-up, so this one must import cleanly when
hydra-submitit-launcher is missing (``pip install 'hybrid[slurm]'`` brings it).
"""

try:
    from hybrid.app.slurm_launcher import PerJobResources
except ImportError:  # hydra-submitit-launcher is not installed: no launcher to offer
    __all__: list[str] = []
else:
    __all__ = ["PerJobLocalLauncher", "PerJobSlurmLauncher"]

    class PerJobSlurmLauncher(PerJobResources):
        _EXECUTOR = "slurm"

    class PerJobLocalLauncher(PerJobResources):
        _EXECUTOR = "local"
