"""``python -m hybrid.bench ft``: hybrid beside torchft on the testbed, fault tolerance on in both, in one command.

Both systems train the same thing from the same Hydra overrides (default: the small transformer on text with
AdamW, :data:`TASK`): the same model, initial weights, data order, global batch, optimizer and schedule (the
torchft side builds them with hybrid's components: :mod:`hybrid.tools.ft_worker`). Each run has 3 testbed
nodes, each node in its own network namespace behind a shaped NIC; the configurations take turns round by
round (the order reversed every other round), so a drift of the machine hits both systems alike.

- **torchft:** its lighthouse (``torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms
  5000``) in the testbed's service namespace, off the nodes; one replica group per node, each a ``torchrun``
  with ``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` set and the node's host name, written as torchft's
  examples are: 1 worker per node (its DDP, Manager and Optimizer), 2 workers per node (FSDP2 inside the
  group, the Manager across groups), DiLoCo (``torchft.local_sgd.DiLoCo`` with fragments).
- **hybrid:** ``python -m hybrid.train`` with ``cluster.recovery=in_place`` (hierarchical on 3x1; sharded with
  and without ``comm.shard_optimizer`` on 3x2; diloco), ``cluster.min_nnodes=2``, ``cluster.rdzv_last_call_s=5``
  (the lighthouse's join timeout).
- **plain:** each system's plain torch DDP / HSDP with the fault tolerance off (hybrid's comm=ddp and comm=hsdp
  with restarts; torch DDP / FSDP2 over one torchrun rendezvous of all nodes on the torchft side), so the cost
  of fault tolerance shows.

Scenarios (one JSON row per configuration and round, and a table of medians over the rounds):

- ``healthy``: samples/s (the samples of a step over the mean step, the first step left out: metrics.json's
  definition);
- ``kill``: node 2's processes SIGKILLed after step :attr:`FtBenchOptions.kill_after`; seconds from the kill to
  the survivors' next step (``kill_to_next_step_s``) and the steps lost;
- ``rejoin``: in the same run, node 2 started again as it was started; seconds from its start to its first step
  (``rejoin_s``), the bytes of state it received and from where;
- ``diloco``: 3x1 at :attr:`FtBenchOptions.diloco_mbit` Mbit/s, H=:attr:`FtBenchOptions.sync_every`, 2
  fragments: samples/s, inter-node bytes per step (the busiest node's NIC) and the mean loss of every worker's
  last steps (``tail_loss``, over metrics.json's ``TAIL_STEPS``, 20, on both sides).

Every row has ``scenario``, ``system``, ``config``, ``layout``, ``identical`` (replicas equal at the end: torchft's
DiLoCo its global copies, which streaming keeps equal while each fragment's local weights differ until its
sync) and, for torchft's, ``torchft_quorums`` (quorums its lighthouse formed, from its log). Needs root (the
testbed) and torchft (``pip install -e '.[peers]'``).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybrid.app.observability.metrics import write_json_atomic

__all__ = ["FtBenchOptions", "RunSpec", "main", "run_ft_bench", "torchft_missing"]

SCENARIOS = ("healthy", "kill", "rejoin", "diloco")
TASK = ("model=transformer", "data=text", "optim=adamw")
LIGHTHOUSE_PORT = 29510
GROUP_PORT = 29400  # each group's torchrun rendezvous, on its own node (torchrun's documented default)
KILLED = 2  # the node lost and started again
LOOKING_FOR = {"hybrid": r"^step (\d+)/", "torchft": r"^\[g0\] ft step (\d+) "}


def torchft_missing() -> str | None:
    """Why torchft cannot run here, or None."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return f"torchft is not installed ({exc}): pip install -e '.[peers]'"
    from shutil import which

    if which("torchft_lighthouse") is None and not (Path(sys.executable).parent / "torchft_lighthouse").exists():
        return "torchft is installed but its torchft_lighthouse command is not on PATH"
    return None


@dataclass(frozen=True)
class RunSpec:
    """One configuration of one system."""

    system: str  # hybrid | torchft
    config: str  # what the row calls it
    layout: str  # NODESxWORKERS
    hybrid: tuple[str, ...] = ()  # hybrid: its overrides
    ft_mode: str = ""  # torchft: hybrid.tools.ft_worker's --mode
    fault_tolerant: bool = True  # False: plain torch (no recovery in place, no torchft Manager)

    @property
    def shape(self) -> tuple[int, int]:
        nodes, workers = self.layout.split("x")
        return int(nodes), int(workers)


HEALTHY = [
    RunSpec("hybrid", "hierarchical, in place", "3x1", ("comm=hierarchical",)),
    RunSpec("torchft", "DDP + Manager", "3x1", ft_mode="ddp"),
    RunSpec("hybrid", "plain torch DDP (comm=ddp)", "3x1", ("comm=ddp",), fault_tolerant=False),
    RunSpec("torchft", "plain torch DDP (no Manager)", "3x1", ft_mode="plain", fault_tolerant=False),
    RunSpec("hybrid", "sharded, in place", "3x2", ("comm=sharded",)),
    RunSpec("hybrid", "sharded + ZeRO, in place", "3x2", ("comm=sharded", "comm.shard_optimizer=true")),
    RunSpec("torchft", "HSDP: FSDP2 in the group + Manager", "3x2", ft_mode="hsdp"),
    RunSpec("hybrid", "plain torch HSDP (comm=hsdp)", "3x2", ("comm=hsdp",), fault_tolerant=False),
    RunSpec("torchft", "plain torch HSDP (no Manager)", "3x2", ft_mode="plain", fault_tolerant=False),
]
RECOVERY = [spec for spec in HEALTHY if spec.fault_tolerant]
DILOCO_RUNS = [
    RunSpec("hybrid", "diloco, 2 fragments, overlap", "3x1",
            ("comm=diloco", "comm.fragments=2", "comm.overlap=true")),
    RunSpec("torchft", "DiLoCo, 2 fragments, fragment_sync_delay 1", "3x1", ft_mode="diloco"),
]


@dataclass
class FtBenchOptions:
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    rounds: int = 3
    layouts: list[str] = field(default_factory=lambda: ["3x1", "3x2"])
    steps: int = 60  # healthy
    recovery_steps: int = 100  # kill and rejoin: enough for the returning node to join before the end
    kill_after: int = 12
    link_mbit: float = 500.0
    diloco_steps: int = 200
    diloco_mbit: float = 50.0
    sync_every: int = 32
    overrides: list[str] = field(default_factory=list)  # after TASK
    timeout_s: float = 600.0  # one run


class Job:
    """Processes whose output lines are read as they come, each line stamped with the time it arrived."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []
        self.processes: list[subprocess.Popen] = []
        self.services: list[subprocess.Popen] = []
        self.seen = 0
        self._readers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, command: list[str], tag: str = "", service: bool = False, **popen: Any) -> subprocess.Popen:
        """Start ``command``; a ``service`` (torchft's lighthouse) outlives the job, so it does not keep
        :meth:`until` waiting once every other process has ended."""
        process = subprocess.Popen(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   start_new_session=True, **popen)
        self.processes.append(process)
        if service:
            self.services.append(process)
        reader = threading.Thread(target=self._read, args=(process, tag), daemon=True)
        reader.start()
        self._readers.append(reader)
        return process

    def _read(self, process: subprocess.Popen, tag: str) -> None:
        for line in process.stdout:
            with self._lock:
                self.lines.append((time.monotonic(), f"{tag}{line}"))

    def until(self, pattern: str, deadline: float, after: float = 0.0) -> tuple[float, re.Match]:
        """The next line (after the last matched, and arrived after ``after``) matching ``pattern``."""
        while time.monotonic() < deadline:
            while self.seen < len(self.lines):
                at, line = self.lines[self.seen]
                self.seen += 1
                if at >= after and (found := re.search(pattern, line, re.MULTILINE)):
                    return at, found
            ended = all(p.poll() is not None for p in self.processes if p not in self.services)
            if ended and self.seen >= len(self.lines):
                break
            time.sleep(0.01)
        raise RuntimeError(f"never saw {pattern!r}; the last lines:\n{self.text()[-4000:]}")

    def text(self) -> str:
        with self._lock:
            return "".join(line for _, line in self.lines)

    def wait(self, processes: list[subprocess.Popen], deadline: float) -> None:
        for process in processes:
            try:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"{process.args[:6]} still runs at the deadline:\n{self.text()[-4000:]}") from None

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait(timeout=30)
        for reader in self._readers:
            reader.join(timeout=10)


def _mean_step_samples_per_s(step_times: list[float], samples_per_step: int) -> float:
    timed = step_times[1:] or step_times
    return samples_per_step / statistics.fmean(timed) if timed else float("nan")


# ---------------------------------------------------------------------------------------------------- hybrid


def _hybrid_command(spec: RunSpec, opts: FtBenchOptions, scenario: str, steps: int, mbit: float) -> list[str]:
    """``trainer.log_every=1`` only where a step's time is read off its line (kill, rejoin): every log step
    gathers each rank's step accounts across the nodes, a meeting of all nodes that a user's default (every 10
    steps) does not hold at each step, and that torchft's loop, printing its own line, does not hold at all."""
    nodes, workers = spec.shape
    elastic = ("cluster.min_nnodes=2", "cluster.max_restarts=2", "cluster.rdzv_last_call_s=5",
               "cluster.recovery=in_place") if spec.fault_tolerant else ()
    return [sys.executable, "-m", "hybrid.train", *TASK, f"cluster.nnodes={nodes}",
            f"cluster.nproc_per_node={workers}", "cluster.testbed.enabled=true",
            f"cluster.testbed.link_mbit={mbit}", *elastic, "trainer.checkpoint_every=0",
            *(["trainer.log_every=1"] if scenario in ("kill", "rejoin") else []),
            f"trainer.max_steps={steps}", "comm.timeout_s=60", "hydra.run.dir=run", *spec.hybrid,
            *([f"comm.sync_every={opts.sync_every}"] if "comm=diloco" in spec.hybrid else []), *opts.overrides]


def _agents(pid: int) -> dict[str, int]:
    from hybrid.tools.job_processes import name, under

    agents: dict[str, int] = {}
    for p in under(pid):  # a parent before its children: the topmost process of each agent's name
        if name(p).startswith("hybrid-agent-"):
            agents.setdefault(name(p), p)
    return agents


def run_hybrid(spec: RunSpec, opts: FtBenchOptions, scenario: str, where: Path) -> dict[str, Any]:
    from hybrid.tools.job_processes import start_again, under

    steps, mbit = _steps_and_rate(scenario, opts)
    job, row = Job(), {}
    deadline = time.monotonic() + opts.timeout_s
    try:
        main = job.start(_hybrid_command(spec, opts, scenario, steps, mbit), cwd=where,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if scenario in ("kill", "rejoin"):
            job.until(rf"^step {opts.kill_after}/", deadline)
            victim = _agents(main.pid)[f"hybrid-agent-{KILLED}"]
            for pid in [victim, *under(victim)]:
                os.kill(pid, signal.SIGKILL)
            kill = time.monotonic()
            _, resumed = job.until(r"^resumed from step (\d+)", deadline)
            at, _ = job.until(LOOKING_FOR["hybrid"], deadline)
            row.update(kill_to_next_step_s=at - kill, steps_lost=opts.kill_after - int(resumed.group(1)))
            if scenario == "rejoin":
                nodes, workers = spec.shape
                log = open(where / "agent-again.log", "w")  # noqa: SIM115 - closed with the run's folder
                again = start_again(KILLED, victim, nodes * workers, testbed_of=main.pid, stdout=log,
                                    stderr=subprocess.STDOUT)
                job.processes.append(again)
                started = time.monotonic()
                job.until(r"^resumed from step (\d+)", deadline)
                at, _ = job.until(LOOKING_FOR["hybrid"], deadline)
                row["rejoin_s"] = at - started
        job.wait([main], deadline)
        out = job.text()
        if main.returncode != 0:
            raise RuntimeError(f"hybrid exited {main.returncode}:\n{out[-4000:]}")
        metrics = json.loads((where / "run" / "metrics.json").read_text())
        moved = re.findall(r"^in place: state as of step \d+ .*", out, re.MULTILINE)
        if scenario == "rejoin":
            row["received"] = moved[-1].split("); ", 1)[1] if moved else ""
            row["received_bytes"] = _bytes_in(row["received"])
        row.update(identical=bool(metrics.get("param_checksums_identical")), steps=metrics.get("steps"),
                   samples_per_s=metrics.get("samples_per_s"), tail_loss=metrics.get("tail_loss"),
                   inter_node_bytes_per_step=metrics.get("nic_tx_bytes_per_step"))
        return row
    finally:
        job.stop()


def _bytes_in(received: str) -> int | None:
    """The bytes hybrid's 'in place: ...' line counts, every receiving rank's ("(N bytes)" after each), or None."""
    found = re.findall(r"\((\d+) bytes\)", received)
    return sum(int(n) for n in found) if found else None


def _steps_and_rate(scenario: str, opts: FtBenchOptions) -> tuple[int, float]:
    if scenario == "diloco":
        return opts.diloco_steps, opts.diloco_mbit
    if scenario in ("kill", "rejoin"):
        return opts.recovery_steps, opts.link_mbit
    return opts.steps, opts.link_mbit


# --------------------------------------------------------------------------------------------------- torchft


def _lighthouse(job: Job, bed: Any) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "2", "--quorum_tick_ms",
               "100", "--join_timeout_ms", "5000", "--bind", f"[::]:{LIGHTHOUSE_PORT}"]
    return job.start([*bed.service.prefix, *command], tag="[lighthouse] ", service=True,
                     env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "info")})


def _group_command(spec: RunSpec, node: int, opts: FtBenchOptions, steps: int, out: Path) -> list[str]:
    from hybrid.runtime.testbed import nic_address

    nodes, workers = spec.shape
    if spec.ft_mode == "plain":  # one rendezvous of every node, on node 0 (torch without torchft)
        rdzv = ["--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-backend", "static",
                "--master-addr", nic_address(0, 0), "--master-port", str(GROUP_PORT)]
    else:  # each replica group its own torchrun on its own node
        rdzv = ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nic_address(node, 0)}:{GROUP_PORT}"]
    extra = ["--fragments", "2", "--fragment-sync-delay", "1"] if spec.ft_mode == "diloco" else []
    overrides = [*TASK, f"trainer.max_steps={steps}", *(["comm=diloco", f"comm.sync_every={opts.sync_every}"]
                                                         if spec.ft_mode == "diloco" else []), *opts.overrides]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(workers), *rdzv,
                "-m", "hybrid.tools.ft_worker", "--mode", spec.ft_mode, "--out", str(out), *extra, *overrides]
    # The node's own host name (a cluster node has one; torchft's Manager advertises it to its peers).
    return ["unshare", "--uts", "sh", "-c", f'hostname hybrid-n{node} && exec "$@"', "sh", *torchrun]


def _start_group(job: Job, bed: Any, spec: RunSpec, node: int, opts: FtBenchOptions, steps: int,
                 out: Path) -> subprocess.Popen:
    from hybrid.runtime.launch import worker_threads
    from hybrid.runtime.testbed import SERVICE_ADDRESS

    nodes, workers = spec.shape
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "REPLICA_GROUP_ID": str(node), "NUM_REPLICA_GROUPS": str(nodes),
           "TORCHFT_LIGHTHOUSE": f"http://{SERVICE_ADDRESS}:{LIGHTHOUSE_PORT}", "GLOO_SOCKET_IFNAME": "nic0",
           "OMP_NUM_THREADS": str(worker_threads(nodes * workers))}
    return job.start([*bed.nodes[node].prefix, *_group_command(spec, node, opts, steps, out)], tag=f"[g{node}] ",
                     env=env)


def _quorums(text: str) -> int:
    """Quorums the lighthouse formed (torchft 0.2.0's lighthouse logs 'Quorum!' for each)."""
    return len(re.findall(r"^\[lighthouse\] .*Quorum!", text, re.MULTILINE))


def _kill_group(job: Job, groups: list[subprocess.Popen], opts: FtBenchOptions, deadline: float) -> dict[str, Any]:
    """SIGKILL group :data:`KILLED` (its torchrun and workers) after step ``kill_after``: the seconds to the
    survivors' next committed step, and the steps they lost (a step after the kill numbered at most the kill's)."""
    from hybrid.tools.job_processes import under

    job.until(rf"^\[g0\] ft step {opts.kill_after} ", deadline)
    victim = groups[KILLED]
    for pid in [victim.pid, *under(victim.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    kill = time.monotonic()
    at, found = job.until(LOOKING_FOR["torchft"], deadline, after=kill)
    victim.wait(timeout=30)
    return {"kill_to_next_step_s": at - kill, "steps_lost": max(0, opts.kill_after + 1 - int(found.group(1)))}


def run_torchft(spec: RunSpec, opts: FtBenchOptions, scenario: str, where: Path) -> dict[str, Any]:
    from hybrid.runtime.testbed import LinkShape, Testbed

    steps, mbit = _steps_and_rate(scenario, opts)
    nodes, workers = spec.shape
    out = where / "results"
    job, row = Job(), {}
    deadline = time.monotonic() + opts.timeout_s
    with Testbed(nodes, LinkShape(mbit)) as bed:
        try:
            if spec.fault_tolerant:
                _lighthouse(job, bed)
            sent_before = bed.sent_bytes()
            groups = [_start_group(job, bed, spec, node, opts, steps, out) for node in range(nodes)]
            if scenario in ("kill", "rejoin"):
                row.update(_kill_group(job, groups, opts, deadline))
                if scenario == "rejoin":
                    started = time.monotonic()
                    groups[KILLED] = _start_group(job, bed, spec, KILLED, opts, steps, out)
                    at, _ = job.until(rf"^\[g{KILLED}\] ft step (\d+) ", deadline)
                    row["rejoin_s"] = at - started
            job.wait(groups if scenario != "kill" else groups[:KILLED], deadline)
            sent = [b - a for a, b in zip(sent_before, bed.sent_bytes())]
            text = job.text()
            if any(g.returncode != 0 for g in groups if scenario != "kill" or g is not groups[KILLED]):
                raise RuntimeError(f"a torchft group failed:\n{text[-6000:]}")
        finally:
            job.stop()
            (where / "torchft.log").write_text(job.text())  # kept for a look after a failure too
    results = [json.loads(p.read_text()) for p in sorted(out.glob("g*-r*.json"))]
    if scenario == "kill":
        results = [r for r in results if r["group"] != KILLED]
    by_rank: dict[int, set[str]] = {}
    for r in results:
        by_rank.setdefault(r["local_rank"], set()).add(r["checksum"])
    first = [r for r in results if r["group"] == 0 and r["local_rank"] == 0][0]
    global_batch = nodes * workers * _batch_size(opts)
    row.update(identical=all(len(c) == 1 for c in by_rank.values()) and len(results) >= 2 * workers,
               steps=first["steps"], samples_per_s=_mean_step_samples_per_s(first["step_times"], global_batch),
               tail_loss=statistics.fmean(r["tail_loss"] for r in results if r["tail_loss"] is not None),
               inter_node_bytes_per_step=max(sent) / max(1, first["steps"]),
               torchft_quorums=_quorums(text) if spec.fault_tolerant else None)
    if scenario == "rejoin":
        back = [r for r in results if r["group"] == KILLED]
        row["received_bytes"] = sum(r["received_bytes"] for r in back)
        sources = sorted(set(re.findall(rf"^\[g{KILLED}\] .*healing is required.*max_step=[1-9]\d*, "
                                        r"recover_src_replica_rank=(\d+)", text, re.MULTILINE)))
        row["received"] = (f"{row['received_bytes']} B in {sum(r['healed'] for r in back)} recoveries from replica "
                           f"rank(s) {', '.join(sources) or '?'} (torchft's {'PGTransport' if spec.ft_mode != 'hsdp' else 'HTTP transport'})")
    return row


def _batch_size(opts: FtBenchOptions) -> int:
    from hybrid.app.checks import compose_train_config

    return compose_train_config([*TASK, *opts.overrides]).data.batch_size


# ------------------------------------------------------------------------------------------------------ runs


def _specs(opts: FtBenchOptions, scenario: str) -> list[RunSpec]:
    if scenario == "diloco":
        return DILOCO_RUNS
    chosen = HEALTHY if scenario == "healthy" else RECOVERY
    return [s for s in chosen if s.layout in opts.layouts]


def run_ft_bench(opts: FtBenchOptions, json_path: Path | None = None) -> list[dict[str, Any]]:
    """Every row, round by round; written to ``json_path`` after each run (a long bench keeps what it has)."""
    rows: list[dict[str, Any]] = []
    scenarios = [s for s in opts.scenarios if s != "kill" or "rejoin" not in opts.scenarios]
    for round_ in range(opts.rounds):
        for scenario in scenarios:
            specs = _specs(opts, scenario)
            for spec in specs if round_ % 2 == 0 else specs[::-1]:
                with tempfile.TemporaryDirectory(prefix="hybrid-bench-ft-") as where:
                    run = run_hybrid if spec.system == "hybrid" else run_torchft
                    started = time.monotonic()
                    try:
                        found = run(spec, opts, scenario, Path(where))
                    except RuntimeError as exc:
                        found = {"error": str(exc)[-3000:]}
                        print(f"{spec.system} {spec.config} ({scenario}): {str(exc)[-3000:]}", file=sys.stderr)
                    for name in (("kill", "rejoin") if scenario == "rejoin" and "kill" in opts.scenarios
                                 else (scenario,)):
                        row = {"scenario": name, "system": spec.system, "config": spec.config,
                               "layout": spec.layout, "round": round_, "fault_tolerant": spec.fault_tolerant,
                               "wall_s": time.monotonic() - started, **found}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                if json_path is not None:
                    write_json_atomic(json_path, {"options": asdict(opts), "rows": rows})
    return rows


FIGURES = {"healthy": ["samples_per_s"], "kill": ["kill_to_next_step_s", "steps_lost"],
           "rejoin": ["rejoin_s", "received_bytes"], "diloco": ["samples_per_s", "inter_node_bytes_per_step",
                                                               "tail_loss"]}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per scenario and configuration: the median of each figure over the rounds, and whether every round's
    replicas were identical."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["scenario"], row["layout"], row["system"], row["config"]), []).append(row)
    out = []
    for (scenario, layout, system, config), found in groups.items():
        ok = [r for r in found if "error" not in r]
        summary = {"scenario": scenario, "layout": layout, "system": system, "config": config,
                   "rounds": len(found), "failed": len(found) - len(ok),
                   "identical": bool(ok) and all(r.get("identical") for r in ok)}
        for figure in FIGURES[scenario]:
            values = [r[figure] for r in ok if isinstance(r.get(figure), (int, float))]
            summary[figure] = statistics.median(values) if values else None
        if system == "torchft":
            summary["torchft_quorums"] = [r.get("torchft_quorums") for r in ok]
        if scenario == "rejoin":
            summary["received"] = next((r.get("received") for r in reversed(ok) if r.get("received")), "")
        out.append(summary)
    return out


def format_table(summary: list[dict[str, Any]]) -> str:
    lines = ["| scenario | layout | system | configuration | figures (median over rounds) | identical | rounds |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        figures = ", ".join(f"{k} {_fmt(s[k])}" for k in FIGURES[s["scenario"]])
        if s["scenario"] == "rejoin" and s.get("received"):
            figures += f"; received {s['received']}"
        if s["system"] == "torchft" and s.get("torchft_quorums"):
            figures += f"; quorums {s['torchft_quorums']}"
        lines.append(f"| {s['scenario']} | {s['layout']} | {s['system']} | {s['config']} | {figures} | "
                     f"{'yes' if s['identical'] else 'NO'} | {s['rounds'] - s['failed']}/{s['rounds']} |")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid.bench ft", description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layouts", default="3x1,3x2", help="healthy, kill and rejoin: of 3x1, 3x2")
    p.add_argument("--steps", type=int, default=FtBenchOptions.steps, help="steps of a healthy run")
    p.add_argument("--recovery-steps", type=int, default=FtBenchOptions.recovery_steps)
    p.add_argument("--diloco-steps", type=int, default=FtBenchOptions.diloco_steps)
    p.add_argument("--kill-after", type=int, default=FtBenchOptions.kill_after)
    p.add_argument("--json", help="where to write every row (default outputs/bench/ft-<time>.json)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the task both systems train (after "
                                                f"{' '.join(TASK)})")
    return p


def _options(args: argparse.Namespace, p: argparse.ArgumentParser) -> FtBenchOptions:
    scenarios = [s for s in args.scenarios.split(",") if s]
    bad = [s for s in scenarios if s not in SCENARIOS]
    if bad or not scenarios:
        p.error(f"--scenarios {args.scenarios!r}: choose from {', '.join(SCENARIOS)}")
    layouts = [lay for lay in args.layouts.split(",") if lay]
    if not layouts or any(lay not in ("3x1", "3x2") for lay in layouts):
        p.error(f"--layouts {args.layouts!r}: choose from 3x1, 3x2")
    for name in ("rounds", "steps", "recovery_steps", "diloco_steps", "kill_after"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.kill_after >= args.recovery_steps:
        p.error(f"--kill-after {args.kill_after} must be below --recovery-steps {args.recovery_steps}")
    return FtBenchOptions(scenarios=scenarios, rounds=args.rounds, layouts=layouts, steps=args.steps,
                          recovery_steps=args.recovery_steps, diloco_steps=args.diloco_steps,
                          kill_after=args.kill_after, overrides=list(args.overrides))


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    opts = _options(args, p)
    output = Path(args.json) if args.json else Path("outputs") / "bench" / f"ft-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if output.exists():
        p.error(f"--json {output} exists: choose another path")
    if (missing := torchft_missing()) is not None:
        p.error(missing)
    from hybrid.runtime.testbed import testbed_available

    if (reason := testbed_available()) is not None:
        p.error(f"the testbed cannot run here: {reason}")
    output.parent.mkdir(parents=True, exist_ok=True)
    rows = run_ft_bench(opts, output)
    print(format_table(summarise(rows)))
    write_json_atomic(output, {"options": asdict(opts), "rows": rows, "summary": summarise(rows)})
    print(f"wrote {output}")
    return 0
