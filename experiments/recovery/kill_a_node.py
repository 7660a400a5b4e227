"""What a lost node costs, per recovery mode: SIGKILL one node's agent and workers mid-run, time it.

For each configuration, N runs of ``python -m hybrid.train`` (3 nodes, ``cluster.min_nnodes=2``): after step 11 the
lost node's agent and every process under it are SIGKILLed; the figure is the time from the kill to the next
``step N/`` line rank 0 prints (the next completed step), with the step it continued from, whether any survivor
process was restarted (its PIDs), and the exit code. Prints one Markdown table.

    python experiments/recovery/kill_a_node.py --runs 3

``--busy`` runs one CPU-bound process per core beside the job (a busy machine); ``--only TEXT`` keeps the
configurations whose label contains TEXT.

``--rejoin``: the lost node's agent is started again 5 s after the kill (``python -m hybrid.runtime.agent JOB_DIR
NODE``); the figure is then the time from that start to the next completed step on 3 nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybrid.tools.job_processes import busy, name, start_again, under

REJOIN_CONFIGS = [
    ("3x1 hierarchical, node 0 back 5 s later, restart", 1, "hierarchical", 0, "restart"),
    ("3x1 hierarchical, node 0 back 5 s later, in place", 1, "hierarchical", 0, "in_place"),
]
CONFIGS = [  # (label, nproc per node, comm, lost node, recovery)
    ("3x1 hierarchical, restart", 1, "hierarchical", 2, "restart"),
    ("3x1 hierarchical, in place", 1, "hierarchical", 2, "in_place"),
    ("3x2 sharded, restart", 2, "sharded", 2, "restart"),
    ("3x2 sharded, in place", 2, "sharded", 2, "in_place"),
    ("3x1 ddp, node 0, in place", 1, "ddp", 0, "in_place"),
    ("3x1 hierarchical, node 0, in place", 1, "hierarchical", 0, "in_place"),
]


def one_run(nproc: int, comm: str, lost: int, recovery: str, where: Path, rejoin: bool = False) -> dict:
    steps = 300 if rejoin else 30
    job = subprocess.Popen(
        [sys.executable, "-m", "hybrid.train", "cluster.nnodes=3", f"cluster.nproc_per_node={nproc}",
         "cluster.min_nnodes=2", "cluster.max_restarts=2", "cluster.rdzv_last_call_s=2", f"cluster.recovery={recovery}",
         f"comm={comm}", "comm.timeout_s=60", f"trainer.max_steps={steps}", "trainer.checkpoint_every=5",
         "trainer.log_every=1", f"model.width={1024 if rejoin else 512}", "data.num_samples=2048", f"data.root={where / 'data'}",
         "hydra.run.dir=run"], cwd=where, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []

    def until(pattern: str) -> re.Match:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = job.stdout.readline()
            if not line:
                break
            lines.append(line)
            if found := re.search(pattern, line):
                return found
        raise RuntimeError(f"never saw {pattern!r}:\n{''.join(lines[-30:])}")

    until(r"^step 11/")
    agents = {name(p): p for p in under(job.pid) if name(p).startswith("hybrid-agent-")}
    workers_before = {p for a in agents.values() for p in under(a) if name(p).startswith("hybrid-rank-")}
    victim = agents[f"hybrid-agent-{lost}"]
    killed = [victim, *under(victim)]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    continued = int(until(r"^resumed from step (\d+)").group(1))
    again = None
    if rejoin:
        time.sleep(max(0.0, 5 - (time.monotonic() - start)))
        again = start_again(lost, victim, 3 * nproc)
        start = time.monotonic()
        continued = int(until(r"^resumed from step (\d+)").group(1))
    until(r"^step \d+/")
    seconds = time.monotonic() - start
    workers_after = {p for p in under(job.pid) if name(p).startswith("hybrid-rank-")}
    rest, _ = job.communicate(timeout=300)
    if again is not None:
        again.wait(timeout=60)
    metrics = json.loads((where / "run" / "metrics.json").read_text()) if job.returncode == 0 else {}
    return {"seconds": seconds, "continued_from": continued, "exit": job.returncode,
            "same_pids": workers_after == workers_before - set(killed),
            "identical": metrics.get("param_checksums_identical"), "steps": metrics.get("steps")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rejoin", action="store_true", help="start the lost node's agent again 5 s later")
    parser.add_argument("--busy", action="store_true", help="one CPU-bound process per core beside every run")
    parser.add_argument("--only", default="", help="run only the configurations whose label contains this")
    args = parser.parse_args()
    with busy(args.busy):
        _table(args)


def _table(args: argparse.Namespace) -> None:
    what = "agent started again -> next completed step on 3 nodes" if args.rejoin else "kill -> next completed step"
    print(f"| configuration | {what} (s), each run | median | continued from step | "
          "survivors' processes kept | exit, steps, replicas |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, nproc, comm, lost, recovery in REJOIN_CONFIGS if args.rejoin else CONFIGS:
        if args.only not in label:
            continue
        runs = []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="hybrid-recovery-") as where:
                runs.append(one_run(nproc, comm, lost, recovery, Path(where), args.rejoin))
        times = [r["seconds"] for r in runs]
        print(f"| {label} | {', '.join(f'{t:.2f}' for t in times)} | {statistics.median(times):.2f} | "
              f"{', '.join(str(r['continued_from']) for r in runs)} | "
              f"{'yes' if all(r['same_pids'] for r in runs) else 'no'} | "
              f"{', '.join(str(r['exit']) for r in runs)}; {runs[0]['steps']} steps; "
              f"{'identical' if all(r['identical'] for r in runs) else 'NOT identical'} |", flush=True)


if __name__ == "__main__":
    main()
