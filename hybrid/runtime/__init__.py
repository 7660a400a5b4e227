"""Processes and networks: the default process group, torch elastic launches (one agent per simulated
node), the network-namespace testbed and Slurm tasks. Imports only :mod:`hybrid.core`."""
