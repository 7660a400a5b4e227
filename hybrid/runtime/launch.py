"""Launch a simulated multi-node job on this machine with torch's elastic agent.

Each simulated node gets its own elastic agent (the engine behind torchrun) in
a process of its own (:mod:`hybrid.runtime.agent`), and the agents meet through a c10d
rendezvous on node 0's address, exactly as the agents of a real multi-node job
meet on node 0. Each node's workers therefore see an honest
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``, and nodes may differ in size
(``Layout((3, 1))``). One big local group would instead let gloo take
intra-machine shortcuts that a real cluster does not have.

By default every node is on loopback. With ``nodes=[NodeNetwork(...)]`` each
agent starts inside its node's network namespace and gloo binds to that
node's NIC (see :mod:`hybrid.runtime.testbed`): the same code path as a real cluster.

The entry point is a picklable function; each worker's return value comes
back to the caller, ordered by global rank. Every wait is bounded: when one
node fails, or the job outlives ``timeout_s``, every agent's process group
(the agent and its workers) is stopped and :class:`LaunchError` says why.
With elastic membership (``min_nnodes``) a lost node ends the job only when
fewer than ``min_nnodes`` are left; the results are the last membership's. On
loopback the rendezvous store of such a job runs in a process of its own
(:mod:`hybrid.runtime.rdzv_store`), so that node 0 can be lost like any other.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hybrid.core.topology import Layout
from hybrid.runtime.agent import STORE_LOST, StoreLost
from hybrid.runtime.distributed import free_port
from hybrid.runtime.forked_server import forking_this_process
from hybrid.runtime.netns import NodeNetwork
from hybrid.runtime.rdzv_store import start_store

__all__ = ["LOOPBACK", "PEER_GRACE_S", "LaunchError", "NodeNetwork", "free_port", "is_consequence", "launch_local",
           "local_agent_env", "start_agent_server", "worker_threads"]

_LOCALHOST = "127.0.0.1"
_RDZV_PORT_IN_NAMESPACE = 29500  # a fresh namespace has every port free


# Errors a worker gets because another one went first: its connections closed, its collective timed out.
_CONSEQUENCE = re.compile(r"CommError|failed on rank|Connection (closed|reset)|Broken pipe|Timed out|timed out|"
                          r"earlier bucket's communication failed|without a result")
# How long a worker that fails on such an error waits before exiting: ten of the agent's looks (0.1 s each),
# so that a peer of its node that died first (a SIGKILL closes its connections at once) is what the agent
# sees exit first and reports as the cause.
PEER_GRACE_S = 1.0


def is_consequence(message: str) -> bool:
    """Whether a failure's message says it followed another worker's (see ``_CONSEQUENCE``)."""
    return bool(_CONSEQUENCE.search(message))


class LaunchError(RuntimeError):
    """A local job failed or timed out; the message names the node and the cause."""


LOOPBACK = NodeNetwork(_LOCALHOST, "lo")


def worker_threads(world_size: int) -> int:
    """Intra-op threads per worker so the workers of one machine share its cores."""
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


def local_agent_env(world_size: int) -> dict[str, str]:
    """Environment of an elastic agent whose node shares this machine with the job's other nodes."""
    return {"OMP_NUM_THREADS": str(worker_threads(world_size)),
            "TORCH_ELASTIC_WORKER_IDENTICAL": "0",
            # Workers get a store of their own per (re)start, hosted by rank 0 on its node's
            # address only (hybrid.runtime.distributed), not the agent's shared one on every interface.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def launch_local(
    layout: Layout,
    entrypoint: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    nodes: Sequence[NodeNetwork] | None = None,
    max_restarts: int = 0,
    min_nnodes: int | None = None,
    last_call_s: int = 10,
    start_method: str = "fork",
    store_network: NodeNetwork | None = None,
    rdzv_endpoint: str | None = None,
    recovery: str = "restart",
    rdzv_backend: str = "c10d",
) -> list[Any]:
    """Run ``entrypoint(*args)`` on every rank of ``layout``; return the results by rank.

    Workers get torchrun's environment (``RANK``, ``LOCAL_RANK``,
    ``GROUP_RANK``, ``MASTER_ADDR`` ...); gloo is bound to each node's NIC
    (loopback unless ``nodes`` says otherwise). ``max_restarts``: how often
    each node's elastic agent restarts its workers after a failure (torchrun's
    ``--max-restarts``); the workers see ``TORCHELASTIC_RESTART_COUNT``.
    ``min_nnodes`` (below the layout's nodes): elastic membership, torchrun's ``--nnodes MIN:MAX``: a lost
    node (its agent gone) does not end the job while at least ``min_nnodes`` are left, and theirs are the
    results. ``last_call_s``: how long a rendezvous that has its minimum waits for more nodes.
    ``start_method``: how each agent starts its workers (torchrun's ``--start-method``). ``fork`` by default:
    a worker is a copy of its agent, which has imported torch and the entry point already, so a worker
    starts in milliseconds instead of paying every import again (seconds of CPU each: experiments/RESULTS.md);
    the agent touches no accelerator and runs no torch op before it forks. ``spawn``: a fresh interpreter per
    worker, torchrun's default. ``store_network``: where an elastic job's store runs off the nodes (see
    :func:`_elastic_store`); ``rdzv_endpoint``: ``HOST:PORT`` of a store someone else runs, joined by every agent.
    ``recovery="in_place"``: a node that comes back (``python -m hybrid.runtime.agent JOB_DIR NODE``; each agent
    writes ``agent-NODE.pid`` there) joins without a restart of the others (:mod:`hybrid.app.state.in_place`).
    ``rdzv_backend="etcd"``: they meet in etcd: ``rdzv_endpoint``'s members, else 3 started for the job
    (:mod:`hybrid.runtime.etcd_cluster`).
    """
    nodes = list(nodes) if nodes is not None else [LOOPBACK] * layout.nnodes
    minimum = min_nnodes or layout.nnodes
    _check_settings(start_method, max_restarts, timeout_s, layout, len(nodes), minimum)
    store = _control_store(rdzv_backend, minimum < layout.nnodes, rdzv_endpoint, nodes, store_network)
    job_dir = _write_job(layout, nodes, entrypoint, args, timeout_s, max_restarts, minimum, last_call_s, start_method,
                         rdzv_endpoint or (store.endpoint if store is not None else None), recovery, rdzv_backend)
    base_env = {**os.environ, **local_agent_env(layout.world_size), **(env or {})}
    agents: list[subprocess.Popen] = []
    try:
        for i, node in enumerate(nodes):
            node_env = dict(base_env)
            if "GLOO_SOCKET_IFNAME" not in (env or {}):  # an explicit env wins; the node's NIC otherwise
                node_env["GLOO_SOCKET_IFNAME"] = node.ifname
            agents.append(_start_agent(job_dir, i, node, node_env, entrypoint))
        _wait(agents, layout, timeout_s, minimum, job_dir=job_dir)
        return _collect(job_dir, agents, minimum)
    finally:
        _stop(agents)
        if store is not None:
            store.stop()
        shutil.rmtree(job_dir, ignore_errors=True)


def _check_settings(start_method: str, max_restarts: int, timeout_s: float, layout: Layout | None = None,
                    node_networks: int = 0, minimum: int = 1) -> None:
    if layout is not None and node_networks != layout.nnodes:
        raise ValueError(f"{node_networks} node networks for a layout of {layout.nnodes} nodes")
    if layout is not None and not 1 <= minimum <= layout.nnodes:
        raise ValueError(f"min_nnodes={minimum} must be in 1..{layout.nnodes}")
    if start_method not in ("fork", "spawn"):
        raise ValueError(f"start_method={start_method!r} must be fork or spawn")
    if max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts} must be >= 0")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")


def _elastic_store(elastic: bool, nodes: Sequence[NodeNetwork], store_network: NodeNetwork | None) -> Any:
    """An elastic job's rendezvous store in a process of its own (so that no node is special: losing node 0 is
    losing any node), on loopback or ``store_network``; started before the agents, stopped after them. None:
    node 0's agent hosts it (a job that needs every node, or nodes in namespaces without a service network)."""
    store_at = store_network or (LOOPBACK if nodes[0] == LOOPBACK else None)
    if not elastic or store_at is None:
        return None
    port = 0 if store_at == LOOPBACK else _RDZV_PORT_IN_NAMESPACE  # 0: the store binds a free one itself
    return start_store(store_at.address, port, store_at.prefix)


def _control_store(rdzv_backend: str, elastic: bool, rdzv_endpoint: str | None, nodes: Sequence[NodeNetwork],
                   store_network: NodeNetwork | None) -> Any:
    """The store this launch starts for its job (None: someone else's, or node 0's agent hosts it)."""
    if rdzv_backend not in ("c10d", "etcd"):
        raise ValueError(f"rdzv_backend={rdzv_backend!r} must be c10d or etcd")
    if rdzv_backend == "etcd":
        return _etcd_store(nodes, store_network) if rdzv_endpoint is None else None
    return _elastic_store(elastic and rdzv_endpoint is None, nodes, store_network)


def _etcd_store(nodes: Sequence[NodeNetwork], store_network: NodeNetwork | None) -> Any:
    """The job's etcd cluster (three members) on loopback or ``store_network``, as :func:`_elastic_store`'s
    store is: ``endpoint`` and ``stop()``."""
    from hybrid.runtime.etcd_cluster import start_etcd

    store_at = store_network or (LOOPBACK if nodes[0] == LOOPBACK else None)
    if store_at is None:
        raise ValueError("rdzv_backend=etcd on nodes in namespaces needs a store_network (the testbed's service "
                         "network) or an rdzv_endpoint naming the members")
    return start_etcd(store_at.address, store_at.prefix)


# What the agents' fork server imports once, so that no agent pays it: torch, its elastic agent, our agent, and
# what the agent imports before forking its workers (hybrid.runtime.agent.BEFORE_FORK).
_AGENT_PRELOAD = ["torch", "torch._dynamo", "torch.distributed.launcher.api",
                  "torch.distributed.elastic.multiprocessing.errors", "hybrid.runtime.agent", "hybrid.runtime.netns"]


class _ForkedAgent:
    """An agent process forked from multiprocessing's fork server, seen through ``subprocess.Popen``'s
    ``pid``, ``poll``, ``wait`` and ``returncode``."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("hybrid agent", timeout or 0)
        return self._process.exitcode


@contextmanager
def _without_main() -> Iterator[None]:
    """Hide the caller's ``__main__`` while multiprocessing starts a process: it would run the caller's main
    script again there (a script that launches at its top level would launch again), and neither the fork
    server nor an agent needs anything of it (the entry point comes from the job file)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_agent_server(entrypoint: Callable[..., Any], *, fork_this_process: bool = False) -> Any:
    """Start the fork server that local agents are forked from (see :func:`_start_agent`), with torch and
    ``entrypoint``'s module imported; return its multiprocessing context. Calling it early lets that import
    run while the caller does other work (the trainer's checks); the first call's entry point is the one
    preloaded, and later calls reuse the server.

    ``fork_this_process``: the server is a fork of this process rather than a fresh interpreter
    (:mod:`hybrid.runtime.forked_server`), for a caller that has imported torch and has run no torch op."""
    import multiprocessing
    from multiprocessing import forkserver

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*_AGENT_PRELOAD, getattr(entrypoint, "__module__", "hybrid.runtime.agent")])
    with _without_main(), (forking_this_process() if fork_this_process else nullcontext()):
        forkserver.ensure_running()
    return context


def _start_agent(job_dir: Path, node: int, network: NodeNetwork, env: dict[str, str],
                 entrypoint: Callable[..., Any]) -> Any:
    """One node's agent, in its own session (stoppable as a whole with its workers).

    Forked from multiprocessing's fork server, which has torch, the elastic agent and the entry point's
    module imported once for the whole launch (each agent would pay about 2.5 s of CPU for them, every
    launch); the server itself is a fresh interpreter that has run no torch op, so forking it is safe. A
    node on loopback runs where it was forked; a testbed node (``network.entry``) is entered in the child
    (:mod:`hybrid.runtime.netns`). A node reached only through its command prefix (a testbed in a user
    namespace) is started as ``python -m hybrid.runtime.agent`` under that prefix."""
    if network.prefix and network.entry is None:
        return subprocess.Popen([*network.prefix, sys.executable, "-m", "hybrid.runtime.agent", str(job_dir), str(node)],
                                env=env, start_new_session=True)
    from hybrid.runtime.agent import run_forked_agent

    context = start_agent_server(entrypoint)
    process = context.Process(target=run_forked_agent, args=(str(job_dir), node, env, network.entry),
                              name=f"hybrid-agent-{node}")
    with _without_main():
        process.start()
    return _ForkedAgent(process)


def _write_job(layout: Layout, nodes: Sequence[NodeNetwork], entrypoint: Callable[..., Any], args: Sequence[Any],
               timeout_s: float, max_restarts: int, min_nnodes: int, last_call_s: int, start_method: str,
               store_endpoint: str | None = None, recovery: str = "restart", rdzv_backend: str = "c10d") -> Path:
    """A fresh job folder with what every agent reads: the rendezvous and layout, and the pickled entry point.
    ``store_endpoint``: a rendezvous store off the nodes (else node 0 hosts it)."""
    port = free_port() if nodes[0] == LOOPBACK else _RDZV_PORT_IN_NAMESPACE
    job_dir = Path(tempfile.mkdtemp(prefix="hybrid-job-"))
    meta = {
        "sys_path": [p for p in sys.path if p],
        "nnodes": layout.nnodes,
        "node_sizes": list(layout.node_sizes),
        "node_addresses": [n.address for n in nodes],
        "run_id": f"hybrid-{uuid.uuid4().hex[:8]}",
        "rdzv_endpoint": store_endpoint or f"{nodes[0].address}:{port}",
        "external_store": store_endpoint is not None,
        "timeout_s": timeout_s,
        "max_restarts": max_restarts,
        "min_nnodes": min_nnodes,
        "last_call_s": last_call_s,
        "start_method": start_method,
        "recovery": recovery,
        "rdzv_backend": rdzv_backend,
    }
    (job_dir / "meta.json").write_text(json.dumps(meta))
    (job_dir / "job.pkl").write_bytes(pickle.dumps((entrypoint, tuple(args))))
    return job_dir


def _collect(job_dir: Path, agents: list[subprocess.Popen], min_nnodes: int | None = None) -> list[Any]:
    """Every node's results, by global rank; a :class:`LaunchError` naming each node that failed. Elastic
    (``min_nnodes`` below the node count): nodes lost on the way are reported, not fatal, when at least
    ``min_nnodes`` finished; the results are theirs (the final membership's ranks)."""
    by_rank: dict[int, Any] = {}
    failures = []
    lost_store = []
    for i, agent in enumerate(agents):
        status, payload = _result(job_dir, i, agent)
        if status == STORE_LOST:
            lost_store.append(str(payload))
        if status != "ok":
            failures.append((i, str(payload)))
        else:
            by_rank.update(payload)
    if lost_store:
        raise StoreLost(f"{lost_store[0]}; every node stopped ({len(lost_store)} said so)")
    finished = len(agents) - len(failures)
    complete = sorted(by_rank) == list(range(len(by_rank))) and bool(by_rank)  # every rank of one membership
    if failures and not (min_nnodes and finished >= min_nnodes and complete):
        raise LaunchError(_describe(failures))
    if failures:
        lost = ", ".join(str(node) for node, _ in failures)
        print(f"node(s) {lost} lost during the run; it finished on the other {finished} (elastic, min_nnodes="
              f"{min_nnodes})", file=sys.stderr, flush=True)
    return [by_rank[rank] for rank in sorted(by_rank)]


def _result(job_dir: Path, node: int, agent: subprocess.Popen) -> tuple[str, Any]:
    outcome = _outcome(job_dir, node)
    if outcome is None:
        return "failed", f"agent exited with code {agent.returncode} without a result"
    return outcome[0], outcome[1]


def _outcome(job_dir: Path, node: int) -> tuple | None:
    """What node ``node``'s agent wrote (status, payload[, nodes of the last membership]); None: nothing yet."""
    try:
        return pickle.loads((job_dir / f"result-{node}.pkl").read_bytes())
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


def _finished_together(job_dir: Path | None, agents: list[subprocess.Popen]) -> bool:
    """Whether as many nodes have finished (a result saying ok: an agent started again for a lost node
    counts too) as their workers' last membership had: the agents still running are lost nodes' (cut off,
    say), with nothing left to wait for."""
    if job_dir is None:
        return False
    outcomes = [_outcome(job_dir, i) for i in range(len(agents))]
    finished = [o[2] for o in outcomes if o is not None and o[0] == "ok" and len(o) > 2]
    return bool(finished) and 0 < max(finished) <= len(finished)


def _describe(failures: list[tuple[int, str]]) -> str:
    """One message for every failed node, the likely cause first.

    When one worker dies, its peers fail too, with communication errors
    (CommError, closed connections, timeouts) that are consequences. Failures
    that are not such errors (a signal, an exception in the training code)
    are listed first.
    """
    ordered = sorted(failures, key=lambda f: (is_consequence(f[1]), f[0]))
    first, rest = ordered[0], ordered[1:]
    message = f"node {first[0]} failed: {first[1]}"
    for node, payload in rest:
        message += f"\n(also) node {node} failed: {payload}"
    return message


def _wait(agents: list[subprocess.Popen], layout: Layout, timeout_s: float, min_nnodes: int | None = None,
          grace_s: float = 10.0, failed_grace_s: float = 5.0, job_dir: Path | None = None) -> None:
    """Until every agent exits. When one fails, the others get ``failed_grace_s`` to fail on their own (so
    their reports are read too; an agent reports within a few seconds of its workers' failure), then the
    launcher stops them: they would only time out, or hang on a rendezvous store they cannot reach. Elastic
    (``min_nnodes``): while at least that many agents have not failed, the job goes on without the others;
    once one has finished, the job has (the last membership's agents finish together), and an agent still
    running after ``grace_s`` is a lost node's (cut off from the rendezvous, say), stopped by the caller; sooner
    where the finished agents' results (in ``job_dir``) say how many nodes the last membership had and that many
    have finished."""
    deadline = time.monotonic() + timeout_s
    elastic = bool(min_nnodes) and min_nnodes < len(agents)
    while True:
        codes = [a.poll() for a in agents]
        if all(c is not None for c in codes):
            return
        if elastic and 0 in codes:
            end = time.monotonic() + grace_s
            while time.monotonic() < end and not _finished_together(job_dir, agents):
                if all(a.poll() is not None for a in agents):
                    return
                time.sleep(0.1)
            return
        if any(c not in (None, 0) for c in codes) and sum(c in (None, 0) for c in codes) < (min_nnodes or len(agents)):
            _wait_each(agents, time.monotonic() + failed_grace_s)
            return  # the failed nodes' result files say why
        if time.monotonic() > deadline:
            raise LaunchError(f"layout {layout} did not finish within timeout_s={timeout_s:g}; stopped all workers")
        running = next((a for a in agents if a.poll() is None), None)
        if running is None:
            continue  # the last ones exited since the poll above: the next round returns
        try:
            running.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass


def _wait_each(agents: list[subprocess.Popen], deadline: float, floor_s: float = 0.0) -> None:
    """Wait for each agent to exit, all by ``deadline`` (each still gets ``floor_s``)."""
    for agent in agents:
        try:
            agent.wait(timeout=max(floor_s, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _stop(agents: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """SIGTERM each agent's process group (the agent stops its workers), then SIGKILL what is left: an agent
    blocked on a store it cannot reach (its node's link is down) does not get to its signal handler."""
    for agent in agents:
        if agent.poll() is None:
            _signal_group(agent, signal.SIGTERM)
    _wait_each(agents, time.monotonic() + grace_s, floor_s=0.1)
    for agent in agents:
        # Workers can outlive an agent that died first: clear the whole group.
        _signal_group(agent, signal.SIGKILL)
        _wait_each([agent], time.monotonic() + 5)


def _signal_group(agent: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(agent.pid, sig)
    except ProcessLookupError:  # a forked agent signalled before its setsid: the process itself
        try:
            os.kill(agent.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    except PermissionError:
        pass
