"""What overlapping ZeRO's weight all-gather with the next step's compute could buy on this machine:
``python experiments/zero_gather_overlap.py`` (one torchrun of ``--nodes`` x ``--workers`` workers, gloo, loopback).

Why this exists: with ``comm.shard_optimizer=true`` each worker steps its slice and the node all-gathers the
updated weights before the next forward (``hybrid.core.node_sharded_optimizer``). FSDP2 hides that gather
behind compute by prefetching the next layer's weights. Whether hiding it pays here is measured, not assumed:
each worker of each node times, in alternating rounds,

- ``compute``: forward and backward of the trainer's MLP (``--width`` x ``--depth``, batch ``--batch``);
- ``gather``: the node's all-gather of the whole model's weights as the trainer does it: 4 MiB pieces, each
  worker's 1/workers of each broadcast by that worker inside the node group (``--collective=all-gather``:
  gloo's one ``all_gather_into_tensor`` instead);
- ``serial``: compute, then gather (what the trainer does today);
- ``overlapped``: the gather started asynchronously, then the forward, then its wait, then the backward: the whole
  gather behind the whole forward, at least as much overlap as a layer-by-layer prefetch before each layer's
  forward (FSDP2's) can give, since the forward needs every weight;
- ``behind-both``: the gather behind the forward and the backward, a bound no schedule reaches (the backward
  needs the weights too).

It prints each variant's median per worker and ``hidden`` = (serial - overlapped) / gather: the share of the
gather's time that overlap takes off a step (1.0: all of it; 0: none), and the machine's busy cores meanwhile.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hybrid.app.components.models import MLP
from hybrid.runtime.launch import worker_threads

VARIANTS = ("compute", "gather", "serial", "overlapped", "behind-both")


def _busy_cores_s() -> float:
    """Core-seconds this machine has been busy since boot (/proc/stat: every cpu field but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = dist.get_rank()
    nodes = [list(range(n * args.workers, (n + 1) * args.workers)) for n in range(args.nodes)]
    groups = [dist.new_group(ranks) for ranks in nodes]
    node = groups[rank // args.workers]
    model = MLP(args.features, args.width, args.depth, 10)  # the trainer's model=mlp
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # The trainer's gather (Communicator.all_gather_shards_): 4 MiB pipeline pieces, each cut into one range per
    # worker, each range broadcast by the worker that owns it.
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % args.workers))  # --collective=all-gather's
    ranges = [(j, part) for piece in flat.split(2**20) for j, part in enumerate(piece.tensor_split(args.workers))]
    x, y = torch.randn(args.batch, args.features), torch.randint(0, 10, (args.batch,))

    def forward() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        return nn.functional.cross_entropy(model(x), y)

    def gather(async_op: bool = False) -> list:
        if args.collective == "all-gather":
            works = [dist.all_gather_into_tensor(padded, padded.chunk(args.workers)[rank % args.workers].clone(),
                                                 group=node, async_op=True)]
        else:
            ours = nodes[rank // args.workers]
            works = [dist.broadcast(part, src=ours[j], group=node, async_op=True) for j, part in ranges]
        if not async_op:
            for work in works:
                work.wait()
        return works

    def run(variant: str) -> None:
        if variant in ("compute", "serial"):
            forward().backward()
        if variant in ("gather", "serial"):
            gather()
        if variant == "overlapped":
            works = gather(async_op=True)
            loss = forward()
            for work in works:
                work.wait()
            loss.backward()
        if variant == "behind-both":
            works = gather(async_op=True)
            forward().backward()
            for work in works:
                work.wait()

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    busy: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:  # warm-up
        run(v)
    for _ in range(args.rounds):
        for v in VARIANTS:
            dist.barrier()
            start, busy_start = time.perf_counter(), _busy_cores_s()
            for _ in range(args.iters):
                run(v)
            dist.barrier()
            wall = time.perf_counter() - start
            times[v].append(wall / args.iters)
            busy[v].append((_busy_cores_s() - busy_start) / wall)
    medians = torch.tensor([statistics.median(times[v]) for v in VARIANTS])
    every = [torch.zeros_like(medians) for _ in range(dist.get_world_size())]
    dist.all_gather(every, medians)
    if rank == 0:
        table = torch.stack(every)
        mb = flat.numel() * 4 / 1e6
        print(f"{args.nodes} node(s) x {args.workers} workers, MLP w{args.width} d{args.depth} batch {args.batch}, "
              f"{mb:.1f} MB of weights gathered per node ({args.collective}); {os.cpu_count()} cores")
        for i, v in enumerate(VARIANTS):
            print(f"  {v:>10}: median {table[:, i].median() * 1e3:7.1f} ms per worker "
                  f"(ranks {table[:, i].min() * 1e3:.1f}..{table[:, i].max() * 1e3:.1f}), "
                  f"busy cores {statistics.median(busy[v]):.2f}")
        ms = dict(zip(VARIANTS, (table[:, i].median().item() * 1e3 for i in range(len(VARIANTS)))))
        for v in ("overlapped", "behind-both"):
            print(f"  {v}: hidden = (serial - {v}) / gather = ({ms['serial']:.1f} - {ms[v]:.1f}) / "
                  f"{ms['gather']:.1f} = {(ms['serial'] - ms[v]) / ms['gather']:.2f}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--collective", choices=("broadcasts", "all-gather"), default="broadcasts",
                        help="the trainer's gather (one broadcast per owner and piece) or gloo's all_gather_into_tensor")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # set for the workers
    args = parser.parse_args()
    for name in ("nodes", "workers", "width", "depth", "features", "batch", "iters", "rounds"):
        if getattr(args, name) < 1:
            sys.exit(f"error: --{name}={getattr(args, name)}; allowed: an integer >= 1")
    if args.worker:
        return worker(args)
    world = args.nodes * args.workers
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--standalone",
                    __file__, "--worker", *(f"--{k}={getattr(args, k)}" for k in
                                            ("nodes", "workers", "width", "depth", "features", "batch", "iters",
                                             "rounds", "collective"))],
                   check=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": str(worker_threads(world))})


if __name__ == "__main__":
    main()
