"""A long run with losses and returns, recovery in place: does anything grow?

``python -m hybrid.train`` on ``--nodes`` x ``--nproc`` (2x2; ``cluster.min_nnodes`` one less,
``cluster.recovery=in_place``) for ``--steps`` steps, a checkpoint every ``--checkpoint-every``; every
``--kill-every`` steps node ``--victim``'s (1) agent and workers are SIGKILLed and, once the survivors go on, its
agent is started again (``python -m hybrid.runtime.agent JOB_DIR NODE``, as the launcher started it) and joins
in place. Every ``--sample-s`` seconds each worker's resident memory (VmRSS) and
open file descriptors are read from /proc, with the step rank 0 last printed.

Writes ``OUT/soak.json`` (the samples, each loss and return with its timings, the run's metrics) and
``OUT/soak.png`` (RSS and descriptors per worker against the step), and prints the figures: each of node 0's
workers (the processes that live through every loss and return) RSS growth between step ``--from-step`` and the
end, and its descriptors' range over that span.

    python experiments/recovery/soak.py --steps 5000 --kill-every 1000 --out experiments/recovery/soak
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hybrid.tools.job_processes import name, start_again, tree, under

HERE = Path(__file__).resolve().parent


def _rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _fds(pid: int) -> dict[str, int] | None:
    """The process's open descriptors by kind (socket, pipe, anon_inode: epoll and the like, file)."""
    kinds: dict[str, int] = {}
    try:
        for entry in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{entry}")
            except OSError:
                continue
            kind = link.split(":", 1)[0] if ":" in link and not link.startswith("/") else "file"
            kinds[kind] = kinds.get(kind, 0) + 1
    except OSError:
        return None
    return kinds


class Output:
    """The job's output, read by a thread: the last step rank 0 printed, and waits for a pattern."""

    def __init__(self, proc: subprocess.Popen, log: Path) -> None:
        self.proc, self.step, self.lines = proc, 0, []
        self._cond = threading.Condition()
        self._log = log.open("w")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            with self._cond:
                self.lines.append(line)
                if found := re.match(r"^step (\d+)/", line):
                    self.step = int(found.group(1))
                self._cond.notify_all()
        self._log.close()
        with self._cond:
            self.lines.append(None)
            self._cond.notify_all()

    def wait_step(self, step: int, timeout_s: float = 600) -> int:
        """Once rank 0 has printed step ``step`` or a later one: the index of the next line to read."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.step < step:
                if self.lines and self.lines[-1] is None:
                    raise RuntimeError(f"the job ended before step {step}:\n{''.join(self.lines[-30:-1])}")
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and \
                        time.monotonic() > deadline:
                    raise RuntimeError(f"never saw step {step} within {timeout_s:g} s")
            return len(self.lines)

    def wait_for(self, pattern: str, after: int, timeout_s: float = 600) -> tuple[int, re.Match]:
        """The first line at index >= ``after`` matching ``pattern``: (its index, the match)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for i in range(after, len(self.lines)):
                    if self.lines[i] is None:
                        raise RuntimeError(f"the job ended before {pattern!r}:\n{''.join(self.lines[-30:-1])}")
                    if found := re.search(pattern, self.lines[i]):
                        return i, found
                after = len(self.lines)
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())) and \
                        time.monotonic() > deadline:
                    raise RuntimeError(f"never saw {pattern!r} within {timeout_s:g} s")


def soak(args: argparse.Namespace, where: Path) -> dict:
    job = subprocess.Popen(
        [sys.executable, "-m", "hybrid.train", f"cluster.nnodes={args.nodes}", f"cluster.nproc_per_node={args.nproc}",
         f"cluster.min_nnodes={args.nodes - 1}",
         "cluster.rdzv_last_call_s=2", "cluster.recovery=in_place", "comm=hierarchical", "comm.timeout_s=60",
         f"trainer.max_steps={args.steps}", f"trainer.checkpoint_every={args.checkpoint_every}",
         "trainer.log_every=1", "model.width=512", "data.num_samples=4096", f"data.root={where / 'data'}",
         "hydra.run.dir=run"], cwd=where, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = Output(job, args.out / "soak.log")
    samples: list[dict] = []
    events: list[dict] = []
    again: list[subprocess.Popen] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            children = tree()
            roots = [job.pid, *(a.pid for a in again if a.poll() is None)]
            now, step = time.monotonic(), out.step
            for root in roots:
                for pid in [root, *under(root, children)] if root != job.pid else under(root, children):
                    process = name(pid)
                    if process.startswith("hybrid-rank-"):
                        agent = next((a for a in [root, *under(root, children)] if pid in children.get(a, [])), None)
                        node = name(agent).removeprefix("hybrid-agent-") if agent else "?"
                        rss, fds = _rss_kb(pid), _fds(pid)
                        if rss is not None and fds is not None:
                            samples.append({"t": now - started, "step": step, "pid": pid, "node": node,
                                            "rss_kb": rss, "fds": sum(fds.values()), "fd_kinds": fds})
            stop.wait(args.sample_s)

    started = time.monotonic()
    out.wait_for(r"^step 1/", 0)
    threading.Thread(target=sample, daemon=True).start()
    seen = 0
    try:
        # The last loss leaves room for the return (about 10 s of steps here) before the run's end.
        for target in range(args.kill_every, args.steps - args.kill_every // 2, args.kill_every):
            seen = out.wait_step(target)
            children = tree()
            agents = [p for p in under(job.pid, children) + [a.pid for a in again if a.poll() is None]
                      if name(p) == f"hybrid-agent-{args.victim}"]
            victim = agents[-1]
            killed = [victim, *under(victim, children)]
            at = out.step
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            seen, found = out.wait_for(r"^resumed from step (\d+)", seen)
            lost_s = time.monotonic() - t0
            seen, _ = out.wait_for(r"^step \d+/", seen)
            t1 = time.monotonic()
            again.append(start_again(args.victim, victim, args.nodes * args.nproc))
            try:
                seen, back = out.wait_for(r"^resumed from step (\d+)", seen)
            except RuntimeError:  # the run ended first: the returning node found nothing to join
                events.append({"killed_at_step": at, "continued_from": int(found.group(1)), "lost_to_resumed_s": lost_s,
                               "rejoined_from": None})
                break
            join_s = time.monotonic() - t1
            seen, _ = out.wait_for(r"^step \d+/", seen)
            events.append({"killed_at_step": at, "continued_from": int(found.group(1)), "lost_to_resumed_s": lost_s,
                           "rejoined_from": int(back.group(1)), "agent_start_to_resumed_s": join_s,
                           "agent_start_to_next_step_s": time.monotonic() - t1})
            print(f"step {at}: node {args.victim} lost, resumed in {lost_s:.2f} s; back, resumed in {join_s:.2f} s",
                  flush=True)
        code = job.wait(timeout=3600)
    finally:
        stop.set()
        if job.poll() is None:
            job.kill()
        for agent in again:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
    metrics = json.loads((where / "run" / "metrics.json").read_text()) if code == 0 else {}
    return {"exit": code, "wall_s": time.monotonic() - started, "events": events, "samples": samples,
            "metrics": {k: metrics.get(k) for k in ("steps", "nnodes", "world_size", "param_checksums_identical",
                                                    "membership")}}


def summarize(result: dict, from_step: int, victim: int, window: int) -> list[str]:
    """Each surviving worker's (one not on node ``victim``) resident set and descriptors, as medians over two
    windows of ``window`` steps: after the first return has settled (from ``from_step`` + ``window``) and at the
    end of the run, so that both are taken with every node training (a sample at a loss or a return catches
    the groups torn down)."""
    import statistics

    lines = []
    by_pid: dict[int, list[dict]] = {}
    for s in result["samples"]:
        by_pid.setdefault(s["pid"], []).append(s)
    for pid, rows in sorted(by_pid.items()):
        if rows[0]["node"] == str(victim):
            continue
        last = rows[-1]["step"]
        early = [r for r in rows if from_step + window <= r["step"] < from_step + 2 * window]
        late = [r for r in rows if r["step"] >= last - window]
        if not early or not late:
            continue
        first_rss, last_rss = (statistics.median(r["rss_kb"] for r in w) / 1024 for w in (early, late))
        first_fds, last_fds = (statistics.median(r["fds"] for r in w) for w in (early, late))
        lines.append(f"worker pid {pid} (node {rows[0]['node']}): RSS {first_rss:.1f} MB (steps {early[0]['step']}-"
                     f"{early[-1]['step']}) -> {last_rss:.1f} MB (steps {late[0]['step']}-{late[-1]['step']}): "
                     f"{100 * (last_rss - first_rss) / first_rss:+.2f}%; open descriptors {first_fds:g} -> {last_fds:g} "
                     f"(every sample: {min(r['fds'] for r in rows)}..{max(r['fds'] for r in rows)})")
    return lines


def plot(result: dict, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    by_pid: dict[int, list[dict]] = {}
    for s in result["samples"]:
        by_pid.setdefault(s["pid"], []).append(s)
    for pid, rows in sorted(by_pid.items()):
        survivor = rows[0]["node"] != str(args.victim)
        style = "-" if survivor else ":"
        label = f"node {rows[0]['node']} pid {pid}" if survivor else None
        top.plot([r["step"] for r in rows], [r["rss_kb"] / 1024 for r in rows], style, label=label)
        bottom.plot([r["step"] for r in rows], [r["fds"] for r in rows], style)
    for event in result["events"]:
        for axis in (top, bottom):
            axis.axvline(event["killed_at_step"], color="grey", alpha=0.3)
    top.set_ylabel("RSS (MB)")
    bottom.set_ylabel("open descriptors")
    bottom.set_xlabel(f"step (grey: node {args.victim} SIGKILLed, then started again)")
    top.legend(fontsize=8)
    top.set_title(f"{args.nodes}x{args.nproc} in place: each worker's memory and descriptors (dotted: node "
                  f"{args.victim}'s, new after each return)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2, help="workers per node")
    parser.add_argument("--victim", type=int, default=1, help="the node killed and started again (not 0: node 0's "
                        "workers are the ones that live through every loss, whose growth is measured)")
    parser.add_argument("--kill-every", type=int, default=1000)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--sample-s", type=float, default=0.5)
    parser.add_argument("--from-step", type=int, default=1000, help="the first loss; growth is measured from a "
                        "window after it")
    parser.add_argument("--window", type=int, default=500, help="steps in each window the medians are taken over")
    parser.add_argument("--out", type=Path, default=HERE / "soak")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hybrid-soak-") as where:
        result = soak(args, Path(where))
    (args.out / "soak.json").write_text(json.dumps(result))
    plot(result, args.out / "soak.png", args)
    print(f"exit {result['exit']}, {result['metrics']['steps']} steps in {result['wall_s']:.0f} s, replicas "
          f"{'identical' if result['metrics']['param_checksums_identical'] else 'NOT identical'}")
    for event in result["events"]:
        back = (f"agent started again -> resumed in {event['agent_start_to_resumed_s']:.2f} s"
                if event.get("rejoined_from") is not None else "the run ended before it was back")
        print(f"  killed at step {event['killed_at_step']}: resumed from {event['continued_from']} in "
              f"{event['lost_to_resumed_s']:.2f} s; {back}")
    joins = [e["agent_start_to_resumed_s"] for e in result["events"] if e.get("rejoined_from") is not None]
    if joins:
        print(f"returns: {len(joins)}, agent start -> resumed on every node: median {sorted(joins)[len(joins) // 2]:.2f} s, "
              f"max {max(joins):.2f} s")
    for line in summarize(result, args.from_step, args.victim, args.window):
        print(line)


if __name__ == "__main__":
    main()
