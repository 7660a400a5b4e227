"""One node of a training job inside a submitit task (``-m hydra/launcher=slurm`` or ``slurm_local``).

hydra-submitit-launcher runs the Hydra app once per submitit task, and
``conf/hydra/launcher/slurm.yaml`` asks for one task per Slurm node. Here that
task becomes the node's torch elastic agent, exactly what torchrun would be
on that node, with ``cluster.nproc_per_node`` workers: one agent per node, not
one task per worker, so the workers get torchrun's honest environment
(``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), the agent restarts them
(``cluster.max_restarts``) and shares out the node's GPUs by local rank.

The tasks agree on the rendezvous without talking: submitit's global task
rank says which task hosts the c10d store (node 0), on the job's first host,
at a port derived from the job id (or ``cluster.rdzv_port``). The workers' ranks come from the c10d
rendezvous, as under torchrun, so global rank 0 need not run on node 0.

On Slurm the agents use torch's defaults, as torchrun does, except that the
workers share the task's CPU allocation (``OMP_NUM_THREADS`` = allocated
cores / workers unless set). submitit's
LocalExecutor has a single node, so ``slurm_local`` runs each simulated node
as one local task, on loopback with the setup of :mod:`hybrid.runtime.launch`
(store and gloo on 127.0.0.1 only, cores shared among all workers).

submitit is imported only inside a task: this module loads without it.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["SlurmNode", "in_submitit_task", "rdzv_port", "slurm_restart"]

_LOCALHOST = "127.0.0.1"
# Below Linux's ephemeral range (32768-60999): an outgoing connection never holds one of these.
_PORT_BASE, _PORT_SPAN = 20000, 12000


def in_submitit_task() -> bool:
    """True inside a task of a submitit job (not in the submitting process, not in the local controller).

    submitit's job script (or local controller) sets ``SUBMITIT_EXECUTOR``;
    ``SUBMITIT_FOLDER`` is set only by the task process that runs the submitted function.
    """
    return bool(os.environ.get("SUBMITIT_EXECUTOR")) and bool(os.environ.get("SUBMITIT_FOLDER"))


def slurm_restart() -> int:
    """How often Slurm has requeued this job (``SLURM_RESTART_COUNT``; 0: its first run, or not under Slurm).

    A requeued job (``scontrol requeue``, preemption with requeue, submitit's requeue before a time limit)
    runs again with the same job id and the same Hydra job directory: it continues its own run from that
    directory's last checkpoint."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) if in_submitit_task() or "SLURM_JOB_ID" in os.environ else 0


def rdzv_port(job_id: str) -> int:
    """The rendezvous port of a job: the same in every task, different for (most) concurrent jobs."""
    return _PORT_BASE + zlib.crc32(job_id.encode()) % _PORT_SPAN


@dataclass(frozen=True)
class SlurmNode:
    """This task's node: its rank among the job's tasks, their number, where they meet."""

    rank: int
    nnodes: int
    job_id: str
    rdzv_host: str
    local: bool  # submitit's LocalExecutor: every node on this machine
    port: int = 0  # cluster.rdzv_port; 0: rdzv_port(job_id)
    external_endpoint: str = ""  # cluster.rdzv_endpoint: a store no node hosts (HOST:PORT); "": the first host's

    @classmethod
    def of_this_task(cls, nnodes: int, port: int = 0, external_endpoint: str = "") -> SlurmNode:
        """This task's node, checked against ``cluster.nnodes`` (one task per node); ``port``: the
        rendezvous port (``cluster.rdzv_port``), 0 to derive it from the job id; ``external_endpoint``: a
        rendezvous store off the nodes (``cluster.rdzv_endpoint``)."""
        import submitit

        job = submitit.JobEnvironment()
        if job.num_tasks != nnodes:
            raise ValueError(
                f"the submitit job has {job.num_tasks} task(s) but cluster.nnodes={nnodes}: one task per node "
                "(hydra/launcher=slurm or slurm_local, without tasks_per_node / nodes overrides)"
            )
        local = job.cluster == "local"
        return cls(job.global_rank, job.num_tasks, job.job_id, _LOCALHOST if local else job.hostnames[0], local,
                   port, external_endpoint)

    @property
    def rdzv_endpoint(self) -> str:
        return self.external_endpoint or f"{self.rdzv_host}:{self.port or rdzv_port(self.job_id)}"

    def run(self, nproc: int, entrypoint: Callable[..., Any], args: Sequence[Any], *,
            timeout_s: float, max_restarts: int = 0, min_nnodes: int | None = None,
            last_call_s: int = 10, recovery: str = "restart", rdzv_backend: str = "c10d") -> dict[int, Any]:
        """Run this node's agent and its ``nproc`` workers; their return values by global rank (this node's).

        ``timeout_s`` bounds the rendezvous: how long the first node waits for the last.
        A failed worker raises torch's ``ChildFailedError``. ``min_nnodes``, ``last_call_s``: elastic
        membership, ``recovery`` and ``rdzv_backend`` (etcd: the members named by ``cluster.rdzv_endpoint``), as
        in :func:`hybrid.runtime.agent.run_node` (whether Slurm lets the other tasks run on after one fails is
        Slurm's policy: ``srun --no-kill`` / ``--kill-on-bad-exit=0``).
        """
        from hybrid.runtime.agent import run_node

        if self.local:
            from hybrid.runtime.launch import local_agent_env

            # Inherited by this node's workers; an explicit GLOO_SOCKET_IFNAME wins, as in launch_local.
            os.environ.update(local_agent_env(self.nnodes * nproc))
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        else:
            # The workers share the cores Slurm gave this task (cpus_per_task), not every core of the node
            # (os.cpu_count): torchrun's agent leaves OMP_NUM_THREADS to the user as well; an explicit one wins.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
            # Workers get a store of their own per (re)start, hosted by rank 0 (hybrid.runtime.distributed), as
            # in a local launch. torch's shared agent store keys each attempt by the agent's own restart count,
            # which differs between an agent whose workers failed (count + 1) and one that restarted them for
            # the new membership (count kept): after a lost node the survivors would meet under different keys
            # and the job hang until its time limit (seen on the Slurm testbed, one run in two).
            os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        return run_node(
            entrypoint, tuple(args), nnodes=self.nnodes, nproc_per_node=nproc, node_rank=self.rank,
            run_id=f"hybrid-{self.job_id}", rdzv_endpoint=self.rdzv_endpoint, timeout_s=timeout_s,
            max_restarts=max_restarts, local_addr=_LOCALHOST if self.local else None, bind_store=self.local,
            min_nnodes=min_nnodes, last_call_s=last_call_s, external_store=bool(self.external_endpoint),
            keep_workers_on_join=recovery == "in_place", rdzv_backend=rdzv_backend,
        )
