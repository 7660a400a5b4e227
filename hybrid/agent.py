"""One simulated node's torch elastic agent, as its own process: ``python -m hybrid.agent JOB_DIR NODE``.

:mod:`hybrid.launch` writes the job (entry point, arguments, layout,
rendezvous) into ``JOB_DIR`` and starts one of these per node, optionally
inside that node's network namespace (``ip netns exec ...``). The agent runs
``elastic_launch`` (torchrun's engine) for its node's workers and writes their
return values, or the failure, to ``JOB_DIR/result-NODE.pkl``.

Exposure: torch's c10d rendezvous creates its TCPStore server listening on
every interface of the machine. Node 0's agent therefore starts that server
first, on a socket bound to the node's own address only (127.0.0.1 for a
local run, the node's testbed address otherwise), as a multi-tenant store;
the rendezvous then finds the server on that port in this process and uses
it instead of opening its own. The workers do not share it: rank 0 hosts a
store of their own per (re)start, bound the same way (:mod:`hybrid.distributed`),
and gloo binds to ``GLOO_SOCKET_IFNAME``, so no socket of a local job listens
beyond its node.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_agent"]


def _write_result(job_dir: Path, node: int, status: str, payload: Any) -> None:
    final = job_dir / f"result-{node}.pkl"
    tmp = job_dir / f".result-{node}.tmp"
    tmp.write_bytes(pickle.dumps((status, payload)))
    os.replace(tmp, final)


def _rank_and_result(entrypoint: Any, *args: Any) -> tuple[int, Any]:
    return int(os.environ["RANK"]), entrypoint(*args)


def _store_on_node_address(endpoint: str, timeout_s: float) -> tuple[socket.socket, Any]:
    """The rendezvous store's server, listening on ``endpoint``'s address only."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from hybrid.distributed import listening_socket

    host, port = endpoint.rsplit(":", 1)
    listener = listening_socket(host, int(port))
    store = TCPStore(host, int(port), is_master=True, multi_tenant=True, master_listen_fd=listener.fileno(),
                     wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    return listener, store


def run_agent(job_dir: Path, node: int) -> int:
    meta = json.loads((job_dir / "meta.json").read_text())
    # The entry point is pickled by reference: make its module importable first.
    sys.path[:0] = [p for p in meta["sys_path"] if p not in sys.path]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    try:
        entrypoint, args = pickle.loads((job_dir / "job.pkl").read_bytes())
        # Kept alive (referenced) until the job ends.
        server = _store_on_node_address(meta["rdzv_endpoint"], meta["timeout_s"]) if node == 0 else None
        config = LaunchConfig(
            min_nodes=meta["nnodes"],
            max_nodes=meta["nnodes"],
            nproc_per_node=meta["node_sizes"][node],
            run_id=meta["run_id"],
            rdzv_backend="c10d",
            rdzv_endpoint=meta["rdzv_endpoint"],
            # Node 0 hosts the rendezvous store; the others connect to it.
            rdzv_configs={"is_host": node == 0, "join_timeout": int(meta["timeout_s"])},
            max_restarts=int(meta.get("max_restarts", 0)),
            monitor_interval=0.1,
            start_method="spawn",
            local_addr=meta["node_addresses"][node],
        )
        per_local_rank = elastic_launch(config, _rank_and_result)(entrypoint, *args)
        del server
        _write_result(job_dir, node, "ok", dict(per_local_rank.values()))
        return 0
    except ChildFailedError as exc:
        _write_result(job_dir, node, "failed", exc.format_msg())
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, then non-zero exit
        _write_result(job_dir, node, "failed", f"{type(exc).__name__}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(run_agent(Path(sys.argv[1]), int(sys.argv[2])))
