"""Launch a simulated multi-node job on this machine with torch's elastic agent.

Each simulated node gets its own elastic agent (the engine behind torchrun),
and the agents meet through a c10d rendezvous on 127.0.0.1, exactly as the
agents of a real multi-node job meet on node 0. Each node's workers therefore
see an honest ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``, and nodes may differ in
size (``Layout((3, 1))``). One big local group would instead let gloo take
intra-machine shortcuts that a real cluster does not have.

The entry point is a picklable function; each worker's return value comes
back to the caller, ordered by global rank. Every wait is bounded: if the
job does not finish within ``timeout_s`` every agent (and with it its
workers) is stopped and :class:`LaunchError` says so.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
import uuid
from typing import Any, Callable, Sequence

from hybrid.topology import Layout

__all__ = ["LaunchError", "free_port", "launch_local", "worker_threads"]

_LOCALHOST = "127.0.0.1"


class LaunchError(RuntimeError):
    """A local job failed or timed out; the message names the node and the cause."""


def free_port(host: str = _LOCALHOST) -> int:
    """A TCP port that was free a moment ago on ``host`` (for the rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def worker_threads(world_size: int) -> int:
    """Intra-op threads per worker so the workers of one machine share its cores."""
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


def _rank_and_result(entrypoint: Callable[..., Any], *args: Any) -> tuple[int, Any]:
    return int(os.environ["RANK"]), entrypoint(*args)


def _agent(
    node_index: int,
    layout: Layout,
    endpoint: str,
    run_id: str,
    timeout_s: float,
    env: dict[str, str],
    entrypoint: Callable[..., Any],
    args: Sequence[Any],
    results: "mp.Queue[tuple[int, str, Any]]",
) -> None:
    # Imported here: the parent may not need torch at all to start agents.
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.update(env)
    config = LaunchConfig(
        min_nodes=layout.nnodes,
        max_nodes=layout.nnodes,
        nproc_per_node=layout.node_sizes[node_index],
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        # The first agent hosts the rendezvous store; the others connect to it.
        rdzv_configs={"is_host": node_index == 0, "join_timeout": int(timeout_s)},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=_LOCALHOST,
    )
    try:
        per_local_rank = elastic_launch(config, _rank_and_result)(entrypoint, *args)
        results.put((node_index, "ok", dict(per_local_rank.values())))
    except ChildFailedError as exc:
        results.put((node_index, "failed", exc.format_msg()))
    except BaseException as exc:
        results.put((node_index, "failed", f"{type(exc).__name__}: {exc}"))


def launch_local(
    layout: Layout,
    entrypoint: Callable[..., Any],
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``entrypoint(*args)`` on every rank of ``layout``; return the results by rank.

    Workers get torchrun's environment (``RANK``, ``LOCAL_RANK``,
    ``GROUP_RANK``, ``MASTER_ADDR`` ...); gloo is bound to the loopback
    interface unless ``env`` says otherwise.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
    worker_env = {
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": str(worker_threads(layout.world_size)),
        "TORCH_ELASTIC_WORKER_IDENTICAL": "0",
    }
    worker_env.update(env or {})
    endpoint = f"{_LOCALHOST}:{free_port()}"
    run_id = f"hybrid-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    agents = [
        ctx.Process(
            target=_agent,
            args=(i, layout, endpoint, run_id, timeout_s, worker_env, entrypoint, tuple(args), results),
            name=f"hybrid-agent-{i}",
        )
        for i in range(layout.nnodes)
    ]
    deadline = time.monotonic() + timeout_s
    by_rank: dict[int, Any] = {}
    try:
        for agent in agents:
            agent.start()
        for _ in agents:
            remaining = deadline - time.monotonic()
            try:
                node_index, status, payload = results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                raise LaunchError(
                    f"layout {layout} did not finish within timeout_s={timeout_s:g}; stopped all workers"
                ) from None
            if status != "ok":
                raise LaunchError(f"node {node_index} failed: {payload}")
            by_rank.update(payload)
    finally:
        _stop(agents)
    return [by_rank[rank] for rank in sorted(by_rank)]


def _stop(agents: list[mp.Process], grace_s: float = 15.0) -> None:
    """Let finished agents exit; SIGTERM the rest (the agent then stops its workers), then SIGKILL."""
    deadline = time.monotonic() + grace_s
    for agent in agents:
        if agent.pid is not None:
            agent.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
    for agent in agents:
        if agent.is_alive():
            agent.terminate()
    for agent in agents:
        if agent.pid is not None:
            agent.join(timeout=max(0.1, deadline - time.monotonic()))
        if agent.is_alive():
            agent.kill()
            agent.join(timeout=5)
