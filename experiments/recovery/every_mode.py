"""Recovery in place in the modes that hold state beside the weights: DiLoCo, adaptive, ZeRO inside the node, HSDP.

Each run is ``python -m hybrid.train`` on the network testbed, 3 nodes x 2 workers, ``cluster.min_nnodes=2``,
``cluster.recovery=in_place``: after step 12 node 2's agent and every process under it are SIGKILLed; the
figure is the time from the kill to the first step rank 0 prints after the survivors resumed. Then node 2's
agent is started again at once (in its testbed namespace, as the launcher started it), and the second figure is
the time from that start to the first step printed after it joined; the row gives the bytes its workers
received and from whom, whether every survivor process was kept, and the run's exit, steps and replicas.

    python experiments/recovery/every_mode.py --runs 3
    python experiments/recovery/every_mode.py --runs 3 --busy     # one CPU-bound process per core beside it
    python experiments/recovery/every_mode.py --loss --runs 3     # DiLoCo's tail loss, lost node against none

``--loss``: the DiLoCo configuration training the small transformer on text, on 3 nodes uninterrupted and with node
2 lost after step 12 (not started again) in place and with restarts, alternating; the mean loss over the last 50
steps of each (metrics.json's ``tail_loss``). Needs root (the testbed).
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
import threading
import time
from pathlib import Path

from hybrid.tools.job_processes import busy, name, start_again, under

STEPS = 400
DILOCO = ("comm=diloco", "comm.sync_every=8", "comm.fragments=2", "comm.overlap=true", "comm.inter_compression=fp8")
CONFIGS = [  # (label, overrides)
    ("diloco H=8, 2 fragments, overlap, fp8", DILOCO),
    ("adaptive, in its DiLoCo mode (from step 4)", ("comm=adaptive", "comm.adapt_every=0", "comm.adapt_plan=[[4,diloco]]",
                                                    "comm.sync_every=8")),
    ("adaptive, in its every-step mode", ("comm=adaptive", "comm.adapt_every=0", f"comm.adapt_plan=[[{10 * STEPS},diloco]]",
                                          "comm.sync_every=8")),
    ("sharded + ZeRO (comm.shard_optimizer), AdamW", ("comm=sharded", "comm.shard_optimizer=true")),
    ("hsdp (torch FSDP2, replicate x shard), AdamW", ("comm=hsdp",)),
]
COMMON = ("cluster.nnodes=3", "cluster.nproc_per_node=2", "cluster.min_nnodes=2", "cluster.max_restarts=2",
          "cluster.rdzv_last_call_s=2", "cluster.recovery=in_place", "cluster.testbed.enabled=true", "comm.timeout_s=60",
          "optim=adamw", "trainer.checkpoint_every=0", "trainer.log_every=1", "hydra.run.dir=run")


class Run:
    """One job, its output read line by line as it comes (so a slow reader never stalls it)."""

    def __init__(self, where: Path, *overrides: str) -> None:
        given = {o.split("=", 1)[0] for o in overrides}  # a row's own value of a common key replaces it
        common = [o for o in COMMON if o.split("=", 1)[0] not in given]
        self.job = subprocess.Popen([sys.executable, "-m", "hybrid.train", *common, *overrides], cwd=where, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[tuple[float, str]] = []
        self.seen = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.job.stdout:
            self.lines.append((time.monotonic(), line))

    def until(self, pattern: str, timeout_s: float = 240) -> tuple[float, re.Match]:
        """The time and match of the next line (after the last one matched) that matches ``pattern``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while self.seen < len(self.lines):
                at, line = self.lines[self.seen]
                self.seen += 1
                if found := re.search(pattern, line):
                    return at, found
            if self.job.poll() is not None and self.seen >= len(self.lines):
                break
            time.sleep(0.01)
        raise RuntimeError(f"never saw {pattern!r}:\n{''.join(line for _, line in self.lines[-400:])}")

    def output(self) -> str:
        self.job.wait(timeout=600)
        self._reader.join(timeout=10)
        return "".join(line for _, line in self.lines)


def agents_and_workers(pid: int) -> tuple[dict[str, int], set[int]]:
    # The topmost process of each agent's name (a process it forks carries the name until it renames itself).
    agents: dict[str, int] = {}
    for p in under(pid):  # a parent before its children
        if name(p).startswith("hybrid-agent-"):
            agents.setdefault(name(p), p)
    return agents, {p for a in agents.values() for p in under(a) if name(p).startswith("hybrid-rank-")}


def one_run(overrides: tuple[str, ...], where: Path, rejoin: bool = True, steps: int = STEPS) -> dict:
    run = Run(where, *overrides, f"trainer.max_steps={steps}")
    run.until(r"^step 12/")
    agents, before = agents_and_workers(run.job.pid)
    victim = agents["hybrid-agent-2"]
    killed = [victim, *under(victim)]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    kill = time.monotonic()
    _, resumed = run.until(r"^resumed from step (\d+)")
    at, _ = run.until(r"^step \d+/")
    result = {"kill_to_next_step_s": at - kill, "continued_from": int(resumed.group(1))}
    _, after = agents_and_workers(run.job.pid)
    result["same_pids"] = after == before - set(killed)
    again = None
    if rejoin:
        log = open(where / "agent-again.log", "w")  # noqa: SIM115 - closed with the run's folder
        again = start_again(2, victim, 6, testbed_of=run.job.pid, stdout=log, stderr=subprocess.STDOUT)
        started = time.monotonic()
        try:
            run.until(r"^resumed from step (\d+)")
            at, _ = run.until(r"^step \d+/")
            result["agent_start_to_step_s"] = at - started
        except RuntimeError:
            if run.job.poll() is None:
                raise
            result["agent_start_to_step_s"] = None  # the job ended before the node could join (a busy machine)
    out = run.output()
    if again is not None:
        again.wait(timeout=60)
    moved = re.findall(r"^in place: state as of step \d+ .*", out, re.MULTILINE)
    joined = rejoin and result["agent_start_to_step_s"] is not None
    result["received"] = moved[-1].split("); ", 1)[1] if joined and moved else ""
    metrics = json.loads((where / "run" / "metrics.json").read_text()) if run.job.returncode == 0 else {}
    result.update(exit=run.job.returncode, steps=metrics.get("steps"), identical=metrics.get("param_checksums_identical"),
                  tail_loss=metrics.get("tail_loss"),
                  history=[m["why"] for m in metrics.get("membership", [])])
    if run.job.returncode != 0:
        result["error"] = out[-2000:]
    return result


def table(args: argparse.Namespace) -> None:
    print("| configuration | kill -> next step (s), each run | continued from | survivors' processes kept | "
          "agent started again -> its first step (s), each run | what the returning node received (last run) | "
          "exit; steps; replicas |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, overrides in CONFIGS:
        if args.only not in label:
            continue
        runs, failed = [], 0
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="hybrid-every-mode-") as where:
                try:
                    runs.append(one_run(overrides, Path(where), steps=args.steps or STEPS))
                except RuntimeError as exc:  # a line never came: say what the job and the returning agent said
                    failed += 1
                    agent_log = Path(where) / "agent-again.log"
                    print(f"{label}: {str(exc)[-3000:]}\n{agent_log.read_text()[-3000:] if agent_log.exists() else ''}",
                          file=sys.stderr)
        for r in runs:
            if r["exit"] != 0:
                print(r.get("error", ""), file=sys.stderr)
        if not runs:
            print(f"| {label} | all {failed} runs failed (stderr) | | | | | |", flush=True)
            continue
        kills = ", ".join(f"{r['kill_to_next_step_s']:.2f}" for r in runs)
        joins = ", ".join("not before the end" if r["agent_start_to_step_s"] is None else f"{r['agent_start_to_step_s']:.2f}"
                          for r in runs)
        print(f"| {label} | {kills} | {', '.join(str(r['continued_from']) for r in runs)} | "
              f"{'yes' if all(r['same_pids'] for r in runs) else 'no'} | {joins} | {runs[-1]['received']} | "
              f"{', '.join(str(r['exit']) for r in runs)}{f' ({failed} more failed)' if failed else ''}; "
              f"{runs[-1]['steps']} steps; "
              f"{'identical' if all(r['identical'] for r in runs) else 'NOT identical'} |", flush=True)


# The task --loss trains: the small transformer on real text (next-byte prediction), whose loss settles (about 1.9
# nats by step 50 here) rather than the MLP on synthetic classes, which memorises its samples and whose per-step
# loss then swings between 0 and above its start under DiLoCo (a tail mean of noise).
LOSS_TASK = ("model=transformer", "data=text")


def loss(args: argparse.Namespace) -> None:
    """DiLoCo's tail loss on a task that settles (:data:`LOSS_TASK`): 3 nodes uninterrupted, and node 2 lost after
    step 12 (not started again), in place and with restarts (from the last of checkpoints every 4 steps),
    alternating."""
    rows: dict[str, tuple[tuple[str, ...], bool]] = {  # label -> (overrides, a node is lost)
        "3 nodes, uninterrupted": ((), False),
        "node 2 lost after step 12, in place": ((), True),
        "node 2 lost after step 12, restart": (("cluster.recovery=restart", "trainer.checkpoint_every=4"), True),
    }
    found: dict[str, list[float]] = {label: [] for label in rows}
    args.steps = args.steps or 200
    for _ in range(args.runs):
        for label, (extra, lost) in rows.items():
            with tempfile.TemporaryDirectory(prefix="hybrid-every-mode-") as where:
                overrides = (*DILOCO, *LOSS_TASK, *extra)
                if lost:
                    found[label].append(one_run(overrides, Path(where), rejoin=False, steps=args.steps)["tail_loss"])
                else:
                    out = Run(Path(where), *overrides, f"trainer.max_steps={args.steps}").output()
                    metrics = Path(where) / "run" / "metrics.json"
                    if not metrics.exists():
                        raise RuntimeError(f"{label}: the run failed:\n{out[-2000:]}")
                    found[label].append(json.loads(metrics.read_text())["tail_loss"])
    base = statistics.fmean(found["3 nodes, uninterrupted"])
    print(f"| DiLoCo run ({args.steps} steps) | mean loss over the last 50 steps, each run | mean | against uninterrupted |")
    print("| --- | --- | --- | --- |")
    for label, values in found.items():
        mean = statistics.fmean(values)
        print(f"| {label} | {', '.join(f'{v:.4f}' for v in values)} | {mean:.4f} | {100 * (mean / base - 1):+.2f}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy", action="store_true", help="one CPU-bound process per core beside every run")
    parser.add_argument("--only", default="", help="run only the configurations whose label contains this")
    parser.add_argument("--loss", action="store_true", help="DiLoCo's tail loss with and without the lost node")
    parser.add_argument("--steps", type=int, default=0,
                        help=f"steps of each run (default {STEPS}; --loss: 200); a busy machine needs more for the "
                             "returning node to join before the end")
    args = parser.parse_args()
    with busy(args.busy):
        (loss if args.loss else table)(args)


if __name__ == "__main__":
    main()
