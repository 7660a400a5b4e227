"""Interleaved A/B of the DDP gradient path: ``torchrun --nproc-per-node 4 experiments/hook_ab.py``.

Why this exists: on a shared 2-core VM the machine's speed drifts by 10-20%
over tens of seconds (measured: the same ``comm=ddp`` trainer run used 53 and
64 ms of CPU per step in two runs a minute apart), so separate trainer runs
per configuration (``python -m hybrid.bench train``) need many rounds to
resolve a few percent. Here every variant lives in the same processes, on
copies of the same model, and they take turns every ``--block`` steps, so the
drift hits all of them alike; the ratio is paired block by block.

Variants: ``ddp`` (DDP's own reduction, no hook), ``flat`` (hybrid's flat
communicator as DDP comm hook), ``flat-sum`` (the same with gloo's
AVG turned off: SUM, then our division in the Future's callback), ``torch-hook`` (torch's Python
``allreduce_hook`` on the same dedicated group), ``hierarchical``,
``sharded``. Each block: barrier, ``--block`` training steps (forward,
backward with the variant's gradient averaging, SGD step, in-place
zero_grad), barrier; the slowest rank's time counts.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.app.components.models import MLP  # noqa: E402
from hybrid.core.comm import CommGroups, make_communicator, register_comm_hook  # noqa: E402
from hybrid.core.topology import WorkerEnv, discover_topology  # noqa: E402

VARIANTS = ("ddp", "flat", "flat-sum", "torch-hook", "hierarchical", "sharded")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="ddp,flat,torch-hook")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--block", type=int, default=10, help="steps per block")
    args = p.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants {args.variants!r}: allowed are {', '.join(VARIANTS)}")

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    topo = discover_topology(WorkerEnv.from_env())
    groups = CommGroups.build(topo, "gloo", "gloo", 120)
    torch.manual_seed(0)
    base = MLP(64, args.width, args.depth, 10)
    models = {}
    for v in variants:
        model = DDP(copy.deepcopy(base), gradient_as_bucket_view=True)  # the MLP has no buffers
        if v == "torch-hook":
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            model.register_comm_hook(groups.world, allreduce_hook)
        elif v == "flat-sum":
            comm = make_communicator("flat", groups)
            comm.transport_avg = False
            register_comm_hook(model, comm)
        elif v != "ddp":
            register_comm_hook(model, make_communicator(v, groups))
        models[v] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
    gen = torch.Generator().manual_seed(topo.rank)
    x, y = torch.randn(args.batch, 64, generator=gen), torch.randint(0, 10, (args.batch,), generator=gen)
    loss_fn = nn.CrossEntropyLoss()

    def step(v: str) -> None:
        model, opt = models[v]
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    for v in variants:
        for _ in range(3):
            step(v)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for b in range(args.blocks):
        shift = b % len(variants)
        for v in variants[shift:] + variants[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                step(v)
            dist.barrier()
            times[v].append((time.perf_counter() - start) / args.block)
    for v in variants:
        slowest = torch.tensor(times[v], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        times[v] = slowest.tolist()
    if topo.rank == 0:
        grad_mb = sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20
        print(f"layout {topo.layout}, MLP width {args.width} depth {args.depth} ({grad_mb:.1f} MiB of gradients), "
              f"{args.blocks} blocks of {args.block} steps, variants taking turns")
        print(f"{'variant':>13} {'step ms':>8} {'speed vs ' + variants[0]:>12} {'quartiles':>11}")
        for v in variants:
            # speed ratio = reference time / this time, paired block by block
            ratios = [r / t for t, r in zip(times[v], times[variants[0]])]
            q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
            print(f"{v:>13} {statistics.median(times[v]) * 1e3:8.2f} {statistics.median(ratios):12.3f} "
                  f"{q1:5.2f}..{q3:4.2f}")
    groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
