"""How to build sharded's intra-node reduce-scatter and all-gather on this transport:
``python experiments/intra_collectives_ab.py`` (it starts one torchrun per variant).

Why this exists: ``hybrid.core.comm.sharded`` could reduce-scatter a pipeline piece
with one ``reduce`` per shard, the transport's ``reduce_scatter_single``, or
one ``all_to_all_single`` plus a local sum, and all-gather it with one
``broadcast`` per shard or ``all_gather_into_tensor``. Which is fastest, and
which costs memory, depends on the backend and torch version, so it is
measured rather than assumed. Each variant runs in its own processes (so peak
RSS is its own) over ``--mb`` MB in pieces of ``--piece-mb`` MiB, with two
pieces in flight as in sharded's pipeline; prints the median time over
``--iters`` iterations and the growth of the peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

# torch 2.13 renamed reduce_scatter_tensor (still there, deprecated) to reduce_scatter_single.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
VARIANTS = ("reduce-per-shard", "reduce-scatter-single", "all-to-all+sum", "broadcast-per-shard",
            "all-gather-into-tensor")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one_pass(variant: str, flat: torch.Tensor, piece: int, spare: list[torch.Tensor]) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    pending: list[tuple[list, torch.Tensor | None, torch.Tensor]] = []
    for k, chunk in enumerate(flat.split(piece)):
        shards = torch.tensor_split(chunk, world)
        if variant == "reduce-per-shard":
            works = [dist.reduce(s, dst=j, async_op=True) for j, s in enumerate(shards)]
        elif variant == "reduce-scatter-single":
            works = [_REDUCE_SCATTER(spare[k % 2][:shards[rank].numel()], chunk, async_op=True)]
        elif variant == "all-to-all+sum":
            inbox = spare[k % 2][:shards[rank].numel() * world]
            works = [dist.all_to_all_single(inbox, chunk, output_split_sizes=[shards[rank].numel()] * world,
                                            input_split_sizes=[s.numel() for s in shards], async_op=True)]
        elif variant == "broadcast-per-shard":
            works = [dist.broadcast(s, src=j, async_op=True) for j, s in enumerate(shards)]
        else:
            works = [dist.all_gather_into_tensor(chunk, shards[rank].clone(), async_op=True)]
        pending.append((works, spare[k % 2] if variant == "all-to-all+sum" else None, chunk))
        if len(pending) == 2:
            works, inbox, done = pending.pop(0)
            for w in works:
                w.wait()
            if inbox is not None:
                mine = torch.tensor_split(done, world)[rank]
                torch.sum(inbox[:mine.numel() * world].view(world, -1), dim=0, out=mine)
    for works, inbox, done in pending:
        for w in works:
            w.wait()
        if inbox is not None:
            mine = torch.tensor_split(done, world)[rank]
            torch.sum(inbox[:mine.numel() * world].view(world, -1), dim=0, out=mine)


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    flat = torch.randn(int(args.mb * 1e6) // 4)
    piece = int(args.piece_mb * 2**20) // 4
    spare = [torch.empty(piece) for _ in range(2)]
    base = _peak_rss_mb()
    _one_pass(args.variant, flat, piece, spare)  # warm-up
    times = []
    for _ in range(args.iters):
        dist.barrier()
        start = time.perf_counter()
        _one_pass(args.variant, flat, piece, spare)
        times.append(time.perf_counter() - start)
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"{args.variant:>24} {world} ranks {args.mb:g} MB in {args.piece_mb:g} MiB pieces: "
              f"median {statistics.median(times):.3f} s, peak RSS +{_peak_rss_mb() - base:.0f} MB", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # set for the worker processes
    parser.add_argument("--mb", type=float, default=80.0)
    parser.add_argument("--piece-mb", type=float, default=4.0)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    if args.variant:
        return worker(args)
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            sys.exit(f"error: --variants holds {variant!r}; allowed: {', '.join(VARIANTS)}")
    for variant in args.variants.split(","):
        # One torchrun per variant: each gets fresh processes, so the peak RSS is its own.
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
                        "--standalone", __file__, f"--variant={variant}", f"--mb={args.mb}",
                        f"--piece-mb={args.piece_mb}", f"--iters={args.iters}"],
                       check=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
