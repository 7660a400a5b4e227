"""Micro-benchmark of the communicators: ``python -m hybrid.bench --layout 2x4 --sizes 1M,25M``.

Times flat / hierarchical / sharded and a bare ``torch.distributed.all_reduce``
on the same tensors, over a layout launched locally (one elastic agent per
simulated node) or, when started by torchrun, over the real job. For each
size it prints the median time, the algorithm bandwidth and the bus bandwidth
with nccl-tests' definitions (algbw = bytes / time; busbw = algbw x 2(n-1)/n,
n = world size), and the per-phase times, and writes everything to JSON.

Each iteration starts after a barrier and its time is the slowest rank's, so
a fast rank cannot hide a slow one. The algorithms take turns iteration by
iteration, in a rotating order (flat, torch, torch-mean; torch, torch-mean,
flat; ...), so a drift of the machine (another
process, thermal, page cache) hits all of them alike, and the table prints
each one's ratio to the bare ``torch`` all-reduce measured in the same run:
the median over iterations of its time over torch's time in the same
iteration (paired, so drift between iterations cancels), with quartiles.

On the testbed (``--testbed-mbit``, ``--testbed-nics``) every node's leader
also reads its NICs' transmit counters (``/proc/net/dev``) around each
iteration: the bytes that really crossed each shaped link, and the link
utilisation ``bytes * 8 / time / rate`` of the busiest one. The ``sharded-inter`` row times the inter-node
phase of ``sharded`` alone (every worker all-reduces its 1/g shard over its
cross group, all in parallel), the figure the link utilisation target is
about.

``python -m hybrid.bench train ...`` is the other mode: it runs the trainer
itself per configuration (:mod:`hybrid.tools.bench_train`); ``python -m hybrid.bench ft ...`` runs
hybrid beside torchft, fault tolerance on in both (:mod:`hybrid.tools.bench_ft`).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybrid.app.observability.metrics import write_json_atomic
from hybrid.core.topology import Layout
from hybrid.core.units import human_size, parse_size
from hybrid.runtime.testbed import MAX_NICS, nic_tx_bytes, per_node_rates

__all__ = ["BenchOptions", "main", "run_bench"]

# "hierarchical+bf16" etc.: that algorithm with its inter-node hop compressed (comm.inter_compression).
COMPRESSED_CHOICES = tuple(f"{a}+{c}" for a in ("hierarchical", "sharded") for c in ("bf16", "fp16"))
ALGORITHM_CHOICES = ("flat", "hierarchical", "sharded", "auto", "torch", "torch-mean", "sharded-inter",
                     *COMPRESSED_CHOICES)
DEFAULT_ALGORITHMS = ("flat", "hierarchical", "sharded", "torch")
DTYPE_CHOICES = ("float32", "float64", "bfloat16", "float16")


@dataclass
class BenchOptions:
    layout: str = "2x2"
    sizes: list[int] = field(default_factory=lambda: [2**20, 25 * 2**20])
    algorithms: list[str] = field(default_factory=lambda: list(DEFAULT_ALGORITHMS))
    iters: int = 10
    warmup: int = 2
    dtype: str = "float32"
    intra_backend: str = "auto"
    inter_backend: str = "auto"
    timeout_s: float = 300.0
    chunk_mb: float = 4.0
    link_mbit: list[float] = field(default_factory=list)  # the testbed's rate per node; empty = loopback
    nics_per_node: int = 1  # the testbed's NICs per node
    probe_mb: float = 4.0  # the link probe's message per direction and pair of nodes; 0: no probe


def _nic_bytes(nics: list[str]) -> list[int]:
    return [nic_tx_bytes(n) for n in nics]


def _time_all(fns: dict[str, Any], tensor: Any, opts: BenchOptions, counters: dict[str, Any],
              nics: list[str], leaders: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Time every algorithm in ``fns`` on ``tensor``, taking turns iteration by iteration.

    Collective. On the testbed (``opts.link_mbit``) the ranks given ``nics``
    (node leaders, ``leaders`` in node order) count the bytes each NIC
    transmits per iteration.
    """
    import torch
    import torch.distributed as dist

    for fn in fns.values():
        for _ in range(opts.warmup):
            tensor.fill_(1)
            fn(tensor)
    for c in counters.values():
        c.reset()
    names = list(fns)
    times = {name: [] for name in names}
    sent = {name: [] for name in names}
    for it in range(opts.iters):
        # Rotate the order too, so every algorithm runs in every position equally often.
        shift = it % len(names)
        for name in names[shift:] + names[:shift]:
            tensor.fill_(1)
            dist.barrier()
            tx = _nic_bytes(nics)
            if opts.link_mbit:
                # No rank may send before every leader has read its counter, or a worker
                # that leaves the first barrier early has bytes on the wire already.
                dist.barrier()
            start = time.perf_counter()
            fns[name](tensor)
            times[name].append(time.perf_counter() - start)
            if opts.link_mbit:
                dist.barrier()  # every rank is done: all of this op's bytes have crossed
                sent[name].append([b - a for a, b in zip(tx, _nic_bytes(nics))] or [0] * opts.nics_per_node)
    out = {}
    for name in names:
        slowest = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        phases: dict[str, float] = {}
        if name in counters:
            snap = counters[name].snapshot()
            keys = sorted(snap)
            per_phase = torch.tensor([snap[k].seconds / opts.iters for k in keys], dtype=torch.float64)
            dist.all_reduce(per_phase, op=dist.ReduceOp.MAX)
            phases = {k: float(v) for k, v in zip(keys, per_phase) if snap[k].calls or v > 0}
        row = {"times_s": slowest.tolist(), "median_s": statistics.median(slowest.tolist()), "phases_s": phases}
        if opts.link_mbit:
            row.update(_nic_summary(sent[name], row["times_s"], opts, leaders))
        out[name] = row
    return out


def _nic_summary(sent: list[list[int]], times: list[float], opts: BenchOptions,
                 leaders: tuple[int, ...]) -> dict[str, Any]:
    """Collective: every leader's per-iteration, per-NIC bytes, gathered. The busiest NIC (against its own
    node's rate) is the bottleneck: ``nic_tx_bytes`` and ``link_utilisation`` are its; ``nic_tx_bytes_by_node``
    holds every NIC's median."""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(sent, dtype=torch.float64)  # iterations x NICs; zeros on non-leaders
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    per_node = torch.stack([every[r] for r in leaders])  # nodes x iterations x NICs
    rates = torch.tensor(opts.link_mbit, dtype=torch.float64).view(-1, 1, 1) * 1e6
    seconds = torch.tensor(times, dtype=torch.float64).view(1, -1, 1)
    util = (per_node * 8 / seconds / rates).amax(dim=(0, 2))  # per iteration: the busiest NIC's
    busiest = per_node.amax(dim=(0, 2))
    return {"nic_tx_bytes": statistics.median(busiest.tolist()),
            "link_utilisation": statistics.median(util.tolist()),
            "nic_tx_bytes_by_node": per_node.median(dim=1).values.tolist()}


def _paired_ratio(times: list[float], reference: list[float]) -> dict[str, float]:
    """Median and quartiles of time / reference time, iteration by iteration.

    Iteration i of every algorithm ran within the same round, back to back, so
    pairing them cancels the machine's drift between rounds; on a loaded
    2-core machine single iterations still vary by +-20%, hence the quartiles.
    """
    ratios = [t / r for t, r in zip(times, reference)]
    if len(ratios) < 2:
        return {"vs_torch": ratios[0], "vs_torch_q1": ratios[0], "vs_torch_q3": ratios[0]}
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"vs_torch": statistics.median(ratios), "vs_torch_q1": q1, "vs_torch_q3": q3}


def _torch_mean(world: int) -> Any:
    """torch's all-reduce plus the division that averaging needs (DDP's default hook divides too)."""
    import torch.distributed as dist

    def run(tensor: Any) -> Any:
        dist.all_reduce(tensor)
        return tensor.div_(world)

    return run


def _inter_phase_only(groups: Any) -> Any:
    """The inter-node phase of ``sharded`` alone: each worker all-reduces its 1/g shard, in parallel."""
    import torch
    import torch.distributed as dist

    topo = groups.topology

    def run(tensor: Any) -> Any:
        shard = torch.tensor_split(tensor.view(-1), topo.local_world_size)[topo.local_rank]
        if topo.nnodes > 1 and shard.numel():
            dist.all_reduce(shard, group=groups.cross)
        return tensor

    return run


def _contenders(opts: BenchOptions, groups: Any, tensor: Any, device: Any) -> tuple[dict, dict, dict]:
    """Per ``--algorithms`` entry: the function that averages (or sums) a tensor, its phase counters where
    it has any, and what it runs as on this layout and tensor."""
    import torch.distributed as dist

    from hybrid.core.comm import PhaseCounters, make_communicator

    fns: dict[str, Any] = {}
    counters: dict[str, Any] = {}
    runs_as: dict[str, str] = {}
    for alg in opts.algorithms:
        if alg == "torch":
            fns[alg], runs_as[alg] = (lambda t: dist.all_reduce(t)), "torch"
        elif alg == "torch-mean":  # what DDP's default hook does: the mean, not the sum
            fns[alg], runs_as[alg] = _torch_mean(groups.topology.world_size), alg
        elif alg == "sharded-inter":
            fns[alg], runs_as[alg] = _inter_phase_only(groups), alg
        else:
            counters[alg] = PhaseCounters()
            name, _, compression = alg.partition("+")
            comm = make_communicator(name, groups, counters[alg], max(1, int(opts.chunk_mb * 2**20)),
                                     compression or "none", device=device)
            fns[alg] = comm.all_reduce_mean_
            # A 16-bit --dtype already travels in 16 bits: shown as running uncompressed.
            runs_as[alg] = comm.name + (f"+{compression}" if comm.compressor.applies_to(tensor) else "")
            if name == "auto":  # what it picked for this size
                runs_as[alg] = f"auto:{comm.decide(tensor.nbytes, tensor.dtype).chosen}"
    return fns, counters, runs_as


def run_bench(opts: BenchOptions) -> dict[str, Any] | None:
    """Run on every rank (already inside a torchrun / launch_local job); rank 0 returns the results."""
    import torch

    from hybrid.core.comm import CommGroups
    from hybrid.core.comm.link_probe import probe_links
    from hybrid.core.topology import discover_topology
    from hybrid.runtime.distributed import init_distributed, shutdown_distributed

    env = init_distributed(opts.timeout_s)
    try:
        topo = discover_topology(env)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        groups = CommGroups.build(topo, opts.intra_backend, opts.inter_backend, opts.timeout_s)
        device = torch.device("cuda", torch.cuda.current_device()) if groups.intra_backend == "nccl" else torch.device("cpu")
        dtype = getattr(torch, opts.dtype)
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = []
        nics = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if opts.link_mbit and topo.is_leader else []
        if "sharded-inter" in opts.algorithms and groups.cross is None:
            raise ValueError(f"sharded-inter needs nodes of equal size, got {list(topo.node_sizes)}")
        links = (probe_links(topo, groups.leaders, max(4, int(opts.probe_mb * 2**20)))
                 if opts.probe_mb > 0 and topo.nnodes > 1 else None)
        for size in opts.sizes:
            tensor = torch.empty(max(1, size // itemsize), dtype=dtype, device=device)
            fns, counters, runs_as = _contenders(opts, groups, tensor, device)
            timings = _time_all(fns, tensor, opts, counters, nics, topo.leaders)
            for alg in opts.algorithms:
                timing = timings[alg]
                nbytes = tensor.nbytes
                algbw = nbytes / timing["median_s"] / 1e9
                world = topo.world_size
                busbw = algbw * 2 * (world - 1) / world if world > 1 else 0.0
                rows.append({"bytes": nbytes, "algorithm": alg, "runs_as": runs_as[alg],
                             "algbw_GBps": algbw, "busbw_GBps": busbw, **timing})
            if "torch" in timings:
                for row in rows[-len(opts.algorithms):]:
                    row.update(_paired_ratio(row["times_s"], timings["torch"]["times_s"]))
        if env.rank != 0:
            return None
        return {
            "layout": str(topo.layout), "node_sizes": list(topo.node_sizes),
            "world_size": topo.world_size, "intra_backend": groups.intra_backend,
            "inter_backend": groups.inter_backend, "dtype": opts.dtype, "device": str(device),
            "torch": torch.__version__, "host": platform.node(), "options": asdict(opts), "results": rows,
            **({"link_probe": {**links.as_dict(), "table": links.table()}} if links is not None else {}),
        }
    finally:
        shutdown_distributed()


def format_table(report: dict[str, Any]) -> str:
    head = (f"layout {report['layout']} (world {report['world_size']}), {report['dtype']} on "
            f"{report['device']}, intra={report['intra_backend']} inter={report['inter_backend']}")
    link = report.get("testbed_link_mbit")
    if link:
        nics = report.get("testbed_nics_per_node", 1)
        rates = link if isinstance(link, (int, float)) else ",".join(f"{r:g}" for r in link)
        head += f", testbed: {nics} NIC(s) per node shaped to {rates} Mbit/s"
    cols = (f"{'size':>10} {'algorithm':>13} {'time ms':>9} {'vs torch':>8} {'quartiles':>10} {'algbw GB/s':>10} {'busbw GB/s':>10}"
            + (f" {'NIC MB':>8} {'link use':>8}" if link else "") + "  phases ms")
    lines = [*report.get("link_probe", {}).get("table", []), head, cols]
    for row in report["results"]:
        phases = " ".join(f"{k}={v * 1e3:.2f}" for k, v in row["phases_s"].items())
        name = row["algorithm"] if row["runs_as"] == row["algorithm"] else f"{row['algorithm']}->{row['runs_as']}"
        ratio = (f"{row['vs_torch']:8.3f} {row['vs_torch_q1']:.2f}..{row['vs_torch_q3']:.2f}"
                 if "vs_torch" in row else f"{'-':>8} {'':>10}")
        nic = (f" {row['nic_tx_bytes'] / 1e6:8.2f} {row['link_utilisation']:8.1%}"
               if "link_utilisation" in row else "")
        lines.append(f"{human_size(row['bytes']):>10} {name:>13} {row['median_s'] * 1e3:9.2f} {ratio} "
                     f"{row['algbw_GBps']:10.3f} {row['busbw_GBps']:10.3f}{nic}  {phases}")
        if "nic_tx_bytes_by_node" in row:
            lines.append(f"{'':>24} MB per NIC by node: " + "  ".join(
                f"n{i}:" + "/".join(f"{b / 1e6:.2f}" for b in node) for i, node in enumerate(row["nic_tx_bytes_by_node"])))
    lines.append("vs torch: median over iterations of time / the bare torch.distributed.all_reduce's time in the "
                 "same iteration (sum only; the algorithms also average); quartiles: of those ratios")
    if link:
        lines.append("NIC MB: bytes the busiest NIC transmitted per call (/proc/net/dev, headers included); link "
                     "use: its bits / time / its shaped rate; MB per NIC by node: every NIC's (nic0/nic1/...)")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hybrid.bench",
        description="Time flat / hierarchical / sharded all-reduce against torch.distributed.all_reduce.",
        epilog="Under torchrun the job's own layout is used and --layout must match it (or be omitted). "
               "'python -m hybrid.bench train --help': the trainer benchmark.",
    )
    p.add_argument("--layout", default=None, help="NNODESxNPROC (e.g. 2x4) or uneven node sizes (e.g. 3,1); default 2x2")
    p.add_argument("--sizes", default="1M,25M", help="comma-separated message sizes, bytes or K/M/G (default 1M,25M)")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHM_CHOICES)} "
                        f"(default: {','.join(DEFAULT_ALGORITHMS)}); sharded-inter is sharded's inter-node "
                        "phase alone; torch-mean is torch's all_reduce followed by the division that averaging needs; "
                        "hierarchical+bf16 (or +fp16, sharded+...) compresses that algorithm's inter-node hop")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per size and algorithm (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="element type (default float32)")
    p.add_argument("--intra-backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--inter-backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--chunk-mb", type=float, default=4.0,
                   help="pipeline piece size of the two-level algorithms, MiB (default 4)")
    p.add_argument("--testbed-mbit", default="0",
                   help="run each node in its own network namespace behind NICs shaped to this many Mbit/s, or "
                        "one rate per node, comma-separated (needs root; default 0 = all nodes on loopback)")
    p.add_argument("--testbed-nics", type=int, default=1,
                   help=f"NICs per node on the testbed, 1..{MAX_NICS} (default 1); gloo uses all of them")
    p.add_argument("--probe-mb", type=float, default=4.0,
                   help="first measure every pair of nodes point to point with this many MiB each way and name a "
                        "node whose links are slow (default 4; 0: skip; needs 2+ nodes, naming one 3+)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck collective fails (default 300)")
    p.add_argument("--output", default=None,
                   help="JSON results file (default: outputs/bench/<layout>-<date>-<time>.json, a new file each run)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    return p


def _options(args: argparse.Namespace, p: argparse.ArgumentParser) -> BenchOptions:
    try:
        layout = str(Layout.parse(args.layout or "2x2"))
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as exc:
        p.error(str(exc))
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    bad = [a for a in algorithms if a not in ALGORITHM_CHOICES]
    if bad or not algorithms:
        p.error(f"--algorithms {args.algorithms!r}: allowed are {', '.join(ALGORITHM_CHOICES)}")
    if not sizes:
        p.error("--sizes is empty: give at least one size, e.g. 1M")
    if args.iters < 1 or args.warmup < 0:
        p.error(f"--iters {args.iters} must be >= 1 and --warmup {args.warmup} >= 0")
    if args.timeout <= 0:
        p.error(f"--timeout {args.timeout} must be > 0 seconds")
    if not args.chunk_mb > 0:
        p.error(f"--chunk-mb {args.chunk_mb} must be > 0")
    if not args.probe_mb >= 0:
        p.error(f"--probe-mb {args.probe_mb} must be >= 0 (0: no link probe)")
    rates = testbed_rates(args.testbed_mbit, Layout.parse(layout).nnodes, p)
    if not 1 <= args.testbed_nics <= MAX_NICS:
        p.error(f"--testbed-nics {args.testbed_nics} must be in 1..{MAX_NICS}")
    return BenchOptions(layout, sizes, algorithms, args.iters, args.warmup, args.dtype,
                        args.intra_backend, args.inter_backend, args.timeout, args.chunk_mb, rates, args.testbed_nics,
                        args.probe_mb)


def testbed_rates(text: str, nnodes: int, p: argparse.ArgumentParser) -> list[float]:
    """``--testbed-mbit``: one rate for every node or one per node; [] for none (loopback)."""
    try:
        rates = [float(r) for r in str(text).split(",") if r.strip()]
    except ValueError:
        p.error(f"--testbed-mbit {text!r}: give Mbit/s as a number, or one per node, comma-separated")
    if rates == [0.0] or not rates:
        return []
    try:
        return per_node_rates(rates, nnodes)
    except ValueError as exc:
        p.error(f"--testbed-mbit {text!r}: {exc}")


def _default_output(layout: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("outputs") / "bench" / f"{layout.replace(',', '-')}-{stamp}.json"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        from hybrid.tools.bench_train import main as train_main

        return train_main(argv[1:])
    if argv[:1] == ["ft"]:
        from hybrid.tools.bench_ft import main as ft_main

        return ft_main(argv[1:])
    p = _parser()
    args = p.parse_args(argv)
    opts = _options(args, p)
    output = Path(args.output) if args.output else _default_output(opts.layout)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ
    rank0 = not under_torchrun or os.environ.get("RANK") == "0"
    if rank0 and output.exists() and not args.overwrite:
        p.error(f"--output {output} exists: pass --overwrite or choose another path")
    if under_torchrun:
        if opts.link_mbit:
            p.error(f"--testbed-mbit {args.testbed_mbit} starts its own nodes: run it without torchrun")
        if args.layout is not None:
            from hybrid.core.topology import WorkerEnv, check_world_size
            check_world_size(Layout.parse(args.layout), WorkerEnv.from_env().world_size)
        report = run_bench(opts)
    else:
        from hybrid.runtime.launch import launch_local

        layout = Layout.parse(opts.layout)
        # Generous: start-up plus every collective's own timeout bounds it anyway.
        budget = opts.timeout_s + 120 + 10 * len(opts.sizes) * len(opts.algorithms) * (opts.iters + opts.warmup)
        if opts.link_mbit:
            from hybrid.runtime.testbed import LinkShape, Testbed, TestbedError

            try:
                with Testbed(layout.nnodes, [LinkShape(r) for r in opts.link_mbit], opts.nics_per_node) as bed:
                    report = launch_local(layout, run_bench, (opts,), timeout_s=budget, nodes=bed.nodes)[0]
            except TestbedError as exc:
                p.error(str(exc))
            rates = opts.link_mbit
            report["testbed_link_mbit"] = rates[0] if len(set(rates)) == 1 else rates
            report["testbed_nics_per_node"] = opts.nics_per_node
        else:
            report = launch_local(layout, run_bench, (opts,), timeout_s=budget)[0]
    if report is not None:
        print(format_table(report))
        output.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(output, report)
        print(f"wrote {output}")
    return 0
