"""How the replicas of a model are kept in sync during training, one module per way:

- :mod:`~hybrid.app.replicas.base`: one process per device, a DDP model whose buckets go through the chosen
  communicator (and what every kind of replica shares: the protocol the loop drives, state access, checks);
- :mod:`~hybrid.app.replicas.node_threads`: one process per node driving its devices' replicas in threads
  (``cluster.intra_mode=thread``);
- :mod:`~hybrid.app.replicas.hsdp`: torch FSDP2 as HSDP (``comm=hsdp``);
- :mod:`~hybrid.app.replicas.torch_hooks`: torch's own DDP communication hooks (``comm.torch_hook``);
- :mod:`~hybrid.app.replicas.diloco`: each node a DiLoCo worker (``comm=diloco``): DDP over the node's own group
  every step, the nodes' outer sync every ``comm.sync_every`` steps (:class:`hybrid.core.diloco.OuterSync`).
"""
