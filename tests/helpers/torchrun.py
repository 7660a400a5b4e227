"""Start a program the way users start a two-node job on one machine: two ``torchrun`` agents, node ranks 0 and 1,
static rendezvous on a free local port; wait for both (with a deadline) and return what they printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hybrid.runtime.launch import free_port

from helpers.background import track

__all__ = ["two_agents"]


def two_agents(args: list[str], cwd: Path, timeout_s: float = 240, nproc_per_node: int = 2,
               env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """(exit code, output) of each agent of ``torchrun --nnodes 2 --nproc-per-node N --node-rank K ... *args``."""
    port = free_port()
    environ = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agents = [track(subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", str(nproc_per_node),
                                      "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                      *args], cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True))
              for node in range(2)]
    try:
        outputs = [agent.communicate(timeout=timeout_s)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)  # the agent and its workers
    return [(agent.returncode, output) for agent, output in zip(agents, outputs)]
