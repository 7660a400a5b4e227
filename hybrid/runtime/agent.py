"""One simulated node's torch elastic agent, as its own process: forked from the launch's fork server
(:func:`run_forked_agent`, which enters a testbed node itself), or ``python -m hybrid.runtime.agent JOB_DIR
NODE`` (under a command prefix that enters the node, where the launcher cannot: a testbed without root).

:mod:`hybrid.runtime.launch` writes the job (entry point, arguments, layout,
rendezvous) into ``JOB_DIR`` and starts one of these per node. The agent runs
``elastic_launch`` (torchrun's engine) for its node's workers and writes their
return values, or the failure, to ``JOB_DIR/result-NODE.pkl``. The agent
itself (:func:`run_node`) also runs each node of a Slurm job (:mod:`hybrid.runtime.slurm`).

Exposure: torch's c10d rendezvous creates its TCPStore server listening on
every interface of the machine. Node 0's agent therefore starts that server
first, on a socket bound to the node's own address only (127.0.0.1 for a
local run, the node's testbed address otherwise), as a multi-tenant store;
the rendezvous then finds the server on that port in this process and uses
it instead of opening its own. The workers do not share it: rank 0 hosts a
store of their own per (re)start, bound the same way (:mod:`hybrid.runtime.distributed`),
and gloo binds to ``GLOO_SOCKET_IFNAME``, so no socket of a local job listens
beyond its node.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from hybrid.runtime.cpu_limit import join_deferred
from hybrid.runtime.distributed import store_server
from hybrid.runtime.etcd_store import ETCD_SCHEME, live_member, retrying
from hybrid.runtime.netns import NodeEntry, enter
from hybrid.runtime.rdzv_store import NODE_ENV, STORE_ENV
from hybrid.runtime.store_watch import StoreWatch

__all__ = ["STORE_LOST", "StoreLost", "attempt_prefix", "name_process", "nodes_at_end_key", "run_agent", "run_forked_agent", "run_node"]


def attempt_prefix(run_id: str, master_addr: str, master_port: str | int) -> str:
    """The store keys of one attempt of one job's recovery in place: the workers of an attempt share torchrun's
    ``MASTER_ADDR`` and ``MASTER_PORT`` (a fresh port each rendezvous round), so a restarted attempt never
    reads an older one's."""
    return f"hybrid/in_place/{run_id}/{master_addr}:{master_port}"


def nodes_at_end_key(run_id: str) -> str:
    """Where the workers leave how many nodes finished: the agents' exit barrier waits for those only, and a
    node that comes back after the job ended learns there that there is nothing left to join. One per job
    (not per rendezvous round: a node that joins in place starts a round the running workers never see)."""
    return f"hybrid/in_place/{run_id}/nodes_at_end"


EXIT_BARRIER_S = 300.0  # torch's own


class StoreLost(RuntimeError):
    """The store the agents meet in (and in-place workers agree in) is gone: no node can go on, and none can
    know what the others did after it went. The job stops; its last checkpoint stands (``trainer.resume=true``)."""


STORE_LOST = "store_lost"  # an agent's result status when its store went


def _agent_class(keep_workers_on_join: bool = False, node: int = 0, endpoint: str = "") -> Any:
    """torch's LocalElasticAgent, with an exit barrier that counts only the nodes that finished, and (recovery
    in place) a node that comes back taken in without restarting the workers.

    After its workers succeed, each agent waits in a barrier for every agent of its rendezvous round. Where
    the workers recovered in place from a lost node, that node's agent never arrives, and the others would
    wait torch's 300 s. The workers leave the number of nodes that finished in the store
    (:func:`nodes_at_end_key`); the barrier waits for that many.

    When a node waits in the rendezvous, torch's agent restarts its workers so that they meet it in a new
    round. In place, the agent joins the new round itself (the new node's workers need it to start) and
    leaves its workers running: they take the new node in at their next agreement (:mod:`hybrid.app.state.in_place`)."""
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.elastic.utils.store import barrier

    class HybridAgent(LocalElasticAgent):
        def _invoke_run(self, role: str = "default") -> Any:
            if endpoint.startswith(ETCD_SCHEME):  # a leader's loss fails a look or two: ride the election out
                handler = self._worker_group.spec.rdzv_handler
                handler.num_nodes_waiting = retrying(handler.num_nodes_waiting)
            watch = StoreWatch(f"hybrid agent: node {node}", endpoint, "stopping this node's workers")
            try:
                return super()._invoke_run(role)
            except RendezvousConnectionError as exc:
                raise StoreLost(f"node {node} {watch.lost(exc)}") from None
            except Exception:
                # The store went (its watch saw it): the exit barrier's DistNetworkError, say, is that loss.
                if watch.said is not None:
                    raise StoreLost(f"node {node} {watch.said}") from None
                raise
            finally:
                watch.stop()

        def _restart_workers(self, worker_group: Any) -> None:
            if not (keep_workers_on_join and worker_group.state == WorkerState.HEALTHY):
                return super()._restart_workers(worker_group)  # a failure: torch's restart
            ids = {w.local_rank: w.id for w in worker_group.workers}
            self._rendezvous(worker_group)
            for worker in worker_group.workers:
                worker.id = ids[worker.local_rank]  # the same processes, which torch's monitor matches by pid
            worker_group.state = WorkerState.HEALTHY

        def _exit_barrier(self) -> None:
            group = self._worker_group
            store = self._store
            raw = getattr(store, "underlying_store", store)
            key = nodes_at_end_key(group.spec.rdzv_handler.get_run_id())
            if not raw.check([key]):
                return super()._exit_barrier()
            nodes = int(raw.get(key))
            try:
                barrier(store, nodes, key_prefix="hybrid/exit_barrier", barrier_timeout=EXIT_BARRIER_S)
            except Exception as exc:  # noqa: BLE001 - as torch's: a late agent does not fail a finished job
                print(f"hybrid agent: exit barrier: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    return HybridAgent


def _write_result(job_dir: Path, node: int, status: str, payload: Any, nodes: int = 0) -> None:
    """The node's outcome for the launcher: status, payload (the results by rank, or the failure) and how many
    nodes the workers' last membership had (0: unknown)."""
    final = job_dir / f"result-{node}.pkl"
    tmp = job_dir / f".result-{node}.tmp"
    tmp.write_bytes(pickle.dumps((status, payload, nodes)))
    os.replace(tmp, final)


def name_process(name: str) -> None:
    """Name this process (``ps -o comm``, /proc/PID/comm; at most 15 characters): agents and workers forked
    from another process share its command line, so the name is what tells them apart."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass  # not Linux: the command line will have to do


def _rank_and_result(entrypoint: Any, *args: Any) -> tuple[int, int, Any]:
    """The worker's global rank, the number of nodes in its membership, and what the entry point returned."""
    # A forked worker inherits the agent's signal handlers (torch's agent turns SIGTERM, SIGINT, SIGHUP and
    # SIGQUIT into exceptions so that it can stop its workers): give it what a fresh interpreter has.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        # Slurm's warning before a time limit (submitit's signal) reaches every process of the job; its default
        # action would end a worker still setting up. The training loop installs its own handler
        # (hybrid.app.state.preemption); until then the warning is ignored.
        warning = getattr(signal, "SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2"), None)
        if warning is not None:
            signal.signal(warning, signal.SIG_IGN)
    name_process(f"hybrid-rank-{os.environ['RANK']}")
    result = entrypoint(*args)
    # Read after the run: recovery in place gives a worker its place in the membership that finished.
    return int(os.environ["RANK"]), int(os.environ["GROUP_WORLD_SIZE"]), result



def _split(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


# What every worker imports anyway, imported once in its agent so that forked workers inherit it: torch's
# optimizers import torch._dynamo when the first one is built (torch._compile._disable_dynamo), about a second
# of CPU in every worker process otherwise.
BEFORE_FORK = ("torch._dynamo",)
_importing: list[threading.Thread] = []  # the thread importing BEFORE_FORK, until the first fork joins it
_import_failed: list[BaseException] = []


def import_before_fork() -> None:
    """Start importing :data:`BEFORE_FORK` in this agent, on a thread of its own: it overlaps the rendezvous,
    which mostly waits for the other agents (an agent started again for a returning node pays its imports on a
    busy machine: 1.6 s of CPU for torch._dynamo alone, quiet). :func:`imported_before_fork` joins it before the
    first worker is forked, so no thread runs at the fork."""
    import importlib

    def run() -> None:
        try:
            for name in BEFORE_FORK:
                importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - raised in the agent's own thread by imported_before_fork
            _import_failed.append(exc)

    if not _importing and not all(name in sys.modules for name in BEFORE_FORK):
        _importing.append(threading.Thread(target=run, name="hybrid-import-before-fork", daemon=True))
        _importing[0].start()


def imported_before_fork() -> None:
    """Wait for :func:`import_before_fork`'s thread (and raise what it raised)."""
    while _importing:
        _importing.pop().join()
    if _import_failed:
        raise _import_failed.pop()


def _imports_first(base: Any) -> Any:
    """``base`` (torch's LocalElasticAgent or ours), which finishes :func:`import_before_fork` before it starts
    (forks) its workers."""

    class ImportsFirst(base):
        def _start_workers(self, worker_group: Any) -> Any:
            imported_before_fork()
            return super()._start_workers(worker_group)

    return ImportsFirst


def run_node(
    entrypoint: Any,
    args: tuple,
    *,
    nnodes: int,
    nproc_per_node: int,
    node_rank: int,
    run_id: str,
    rdzv_endpoint: str,
    timeout_s: float,
    max_restarts: int = 0,
    local_addr: str | None = None,
    bind_store: bool = True,
    min_nnodes: int | None = None,
    last_call_s: int = 10,
    start_method: str = "spawn",
    external_store: bool = False,
    keep_workers_on_join: bool = False,
    rdzv_backend: str = "c10d",
    log_dir: str | None = None,
) -> dict[int, Any]:
    """Run this node's elastic agent and its workers; return the workers' results by global rank.

    Shared by :mod:`hybrid.runtime.launch` and :mod:`hybrid.runtime.slurm`. ``bind_store``: node 0 starts the
    rendezvous store itself, on the endpoint's address only; without it torch's c10d rendezvous opens the store as
    under torchrun, on every interface. ``local_addr``: this node's address as the workers see it (``MASTER_ADDR``
    when rank 0 is here); None: the hostname, as torchrun does. A failed worker raises torch's ``ChildFailedError``.
    ``min_nnodes`` below ``nnodes``: elastic membership (torchrun's ``--nnodes MIN:MAX``): the rendezvous completes
    with at least that many nodes after waiting ``last_call_s`` for more, a node without a heartbeat for ~3 s is
    dropped, and a node that (re)joins waits until the running agents see it and restart their workers on the larger
    membership. ``start_method``: torchrun's ``--start-method`` (``spawn``, or ``fork``: a copy of this agent, no
    accelerator touched). ``external_store``: the store at ``rdzv_endpoint`` is off the nodes
    (:mod:`hybrid.runtime.rdzv_store`), every agent its client. ``keep_workers_on_join`` (recovery in place): a node
    that comes back is taken in without restarting this node's workers (:func:`_agent_class`).
    ``rdzv_backend="etcd"``: ``rdzv_endpoint`` names the members of an etcd cluster (``H1:P1,H2:P2,...``) for torch's
    etcd-v2 rendezvous and the workers' quorum (:mod:`hybrid.runtime.etcd_store`). ``log_dir``: for the workers' error
    files (None: torch's ``torchelastic_*`` folder in the temp dir).
    """
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    on_etcd = rdzv_backend == "etcd"
    external_store = external_store or on_etcd
    _prepare_agent(node_rank, (ETCD_SCHEME + rdzv_endpoint if on_etcd else rdzv_endpoint) if external_store else None,
                   keep_workers_on_join)
    hosts = node_rank == 0 and not external_store
    server = store_server(*_split(rdzv_endpoint), timeout_s) if hosts and bind_store else None  # kept until the end
    minimum = min_nnodes or nnodes
    backend, endpoint, rdzv_configs = _rendezvous(on_etcd, rdzv_endpoint, hosts, timeout_s, minimum < nnodes,
                                                  last_call_s)
    config = LaunchConfig(min_nodes=minimum, max_nodes=nnodes, nproc_per_node=nproc_per_node, run_id=run_id,
                          rdzv_backend=backend, rdzv_endpoint=endpoint, rdzv_configs=rdzv_configs,
                          max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method,
                          local_addr=local_addr, logs_specs=DefaultLogsSpecs(log_dir=log_dir))
    per_local_rank = elastic_launch(config, _rank_and_result)(entrypoint, *args)
    nodes = min(nodes for _, nodes, _ in per_local_rank.values())
    if bind_store and not external_store:  # the server is dropped only after this, when run_node returns
        _leave_together(server, rdzv_endpoint, run_id, nodes)
    LAST_MEMBERSHIP_NODES[0] = nodes
    return {rank: result for rank, _, result in per_local_rank.values()}


def _rendezvous(on_etcd: bool, endpoint: str, hosts: bool, timeout_s: float, elastic: bool,
                last_call_s: int) -> tuple[str, str, dict[str, Any]]:
    """torch's rendezvous backend, endpoint and settings for this node's agent."""
    # Node 0 hosts the store (unless it is off the nodes), said explicitly: simulated nodes share one hostname.
    configs: dict[str, Any] = {"join_timeout": int(timeout_s)} if on_etcd else {"is_host": hosts,
                                                                               "join_timeout": int(timeout_s)}
    if elastic:
        configs.update(last_call_timeout=int(last_call_s), keep_alive_interval=1, keep_alive_max_attempt=3)
    if on_etcd:  # torch's etcd-v2 backend takes one member and learns the others from it
        return "etcd-v2", live_member(endpoint), configs
    return "c10d", endpoint, configs


# How many nodes the workers' last membership had, as the last run_node in this process saw it: what the
# launcher waits for before it stops the agents of nodes lost on the way (see hybrid.runtime.launch._wait).
LAST_MEMBERSHIP_NODES = [0]


def _prepare_agent(node_rank: int, external_endpoint: str | None, keep_workers_on_join: bool) -> None:
    """What this process's workers inherit, and the agent class: the node's name for recovery in place (the
    same if its agent starts again); with a store off the nodes, where the workers find it (recovery in place
    meets there) and an exit barrier that counts the nodes that finished (:func:`_agent_class`). This process
    is the node's agent and nothing else: the launcher's agent class is ours for its lifetime. Also imports
    what the workers would each import (:data:`BEFORE_FORK`), meanwhile."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api as launcher_api

    import_before_fork()
    name_rendezvous_events_cheaply()
    os.environ[NODE_ENV] = str(node_rank)
    agent_class = LocalElasticAgent
    if external_endpoint is not None:
        os.environ[STORE_ENV] = external_endpoint
        agent_class = _agent_class(keep_workers_on_join, node_rank, external_endpoint)
    launcher_api.LocalElasticAgent = _imports_first(agent_class)


def _method_name(depth: int = 2) -> str:
    """torch's ``get_method_name``: the name of the function ``depth`` frames up from this one."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def name_rendezvous_events_cheaply() -> None:
    """torch's dynamic rendezvous names each event it records (every join, close and keep-alive: one a second
    per agent in an elastic job) by its method, which it finds with ``inspect.stack()`` twice: that reads the
    source lines of every frame on the stack, about 20 s of CPU over this project's test run. The same name
    comes from the frame itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    dynamic_rendezvous.get_method_name = _method_name


LEAVE_TIMEOUT_S = 10.0


def _leave_together(server: tuple[socket.socket, Any] | None, endpoint: str, run_id: str, nodes: int) -> None:
    """Keep node 0's rendezvous store up until every other agent has closed its rendezvous.

    After the workers succeed, each agent passes torch's exit barrier and then closes the rendezvous, which
    writes to the store node 0's agent hosts: were node 0 to drop the store once its own close was done, a
    later agent's close would fail with a connection error and a C++ stack trace ("has failed to shutdown the
    rendezvous"). So each other agent counts itself out in the store once closed, and node 0 waits for the
    ``nodes - 1`` of its final membership (at most :data:`LEAVE_TIMEOUT_S`)."""
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    key = f"hybrid/{run_id}/agents_left"
    if server is not None:
        host_store = server[1]
        deadline = time.monotonic() + LEAVE_TIMEOUT_S
        while host_store.add(key, 0) < nodes - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        return
    host, port = endpoint.rsplit(":", 1)
    try:
        TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=LEAVE_TIMEOUT_S)).add(key, 1)
    except (RuntimeError, OSError):
        pass  # node 0 has gone already (it waited its limit): nothing is left to close


def run_forked_agent(job_dir: str, node: int, env: dict[str, str], entry: NodeEntry | None = None) -> None:
    """The agent of a local node, forked from multiprocessing's fork server (see
    :func:`hybrid.runtime.launch.launch_local`): its own session, inside its testbed node where ``entry`` names
    one, the node's environment, and torch's threads as ``OMP_NUM_THREADS`` says (torch read the server's
    environment when the server imported it)."""
    os.setsid()
    if entry is not None:
        try:
            enter(entry)
        except OSError as exc:  # reported to the launcher, which names the node
            _write_result(Path(job_dir), node, "failed", f"cannot enter testbed node {entry.netns}: {exc}")
            sys.exit(1)
    os.environ.clear()
    os.environ.update(env)
    threads = int(env.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        import torch

        torch.set_num_threads(threads)  # sets the count only: no thread starts before the workers fork
    sys.exit(run_agent(Path(job_dir), node))


def run_agent(job_dir: Path, node: int) -> int:
    name_process(f"hybrid-agent-{node}")
    # Who runs this node now (an agent started again for a lost node writes its own): tests and tools find a
    # node's job folder by it.
    (job_dir / f"agent-{node}.pid").write_text(str(os.getpid()))
    meta = json.loads((job_dir / "meta.json").read_text())
    # The entry point is pickled by reference: make its module importable first.
    sys.path[:0] = [p for p in meta["sys_path"] if p not in sys.path]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        entrypoint, args = pickle.loads((job_dir / "job.pkl").read_bytes())
        join_deferred()  # a node with less CPU: its imports are done; every worker starts inside the limit
        by_rank = run_node(
            entrypoint, args, nnodes=meta["nnodes"], nproc_per_node=meta["node_sizes"][node], node_rank=node,
            run_id=meta["run_id"], rdzv_endpoint=meta["rdzv_endpoint"], timeout_s=meta["timeout_s"],
            max_restarts=int(meta.get("max_restarts", 0)), local_addr=meta["node_addresses"][node],
            min_nnodes=meta.get("min_nnodes"), last_call_s=int(meta.get("last_call_s", 10)),
            start_method=meta.get("start_method", "spawn"), external_store=bool(meta.get("external_store")),
            keep_workers_on_join=meta.get("recovery") == "in_place", rdzv_backend=meta.get("rdzv_backend", "c10d"),
            log_dir=str(job_dir / "logs"),
        )
        _write_result(job_dir, node, "ok", by_rank, LAST_MEMBERSHIP_NODES[0])
        return 0
    except StoreLost as exc:
        _write_result(job_dir, node, STORE_LOST, str(exc))
    except ChildFailedError as exc:
        _write_result(job_dir, node, "failed", exc.format_msg())
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then non-zero exit
        _write_result(job_dir, node, "failed", f"{type(exc).__name__}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(run_agent(Path(sys.argv[1]), int(sys.argv[2])))
