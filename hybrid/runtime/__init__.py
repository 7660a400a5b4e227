"""Processes and networks: the default process group, torch elastic launches (one agent per simulated
node), the network-namespace testbed and CPU limits, Slurm tasks and a real Slurm cluster on the testbed, the
rendezvous store off the nodes (c10d or etcd) and the watch on it, the survivors' quorum, the exit barrier,
and a long-lived worker's C heap. Imports only :mod:`hybrid.core`."""
