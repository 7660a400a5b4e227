"""The pluggable parts of a run that hybrid ships: models, datasets and their loader, losses, optimizers.

Each is what a config's ``_target_`` names (``conf/model``, ``conf/data``, ``conf/loss``, ``conf/optim``);
a user's own parts plug in beside them the same way (see :mod:`hybrid.app.targets`).
"""
