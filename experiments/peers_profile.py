"""Where comm=hsdp's step goes, against comm=sharded, on the same 2x4 layout (why HSDP is slower here, measured).

Runs the trainer's own per-rank code (hybrid.app.worker.train_worker) for a few steps under torch.profiler on
every rank and prints rank 0's top operators by self CPU time, for each comm. Loopback (no testbed): the network
is not the limit here, so what differs is what each comm does besides sending bytes across nodes.

    python experiments/peers_profile.py [--steps 8] [--comms hsdp,sharded] [model overrides...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def profiled_run(overrides: list[str], run_dir: str) -> str | None:
    from hybrid.app.checks import compose_train_config
    from hybrid.app.observability.metrics import NullMetrics
    from hybrid.app.worker import train_worker
    from hybrid.core.topology import discover_topology
    from hybrid.runtime.distributed import init_distributed, shutdown_distributed

    env = init_distributed(timeout_s=300)
    try:
        topology = discover_topology(env)
        torch.set_num_threads(1)
        cfg = compose_train_config(overrides)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train_worker(cfg, topology, torch.device("cpu"), Path(run_dir), NullMetrics(), env.rank)
        if env.rank != 0:
            return None
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48)
    finally:
        shutdown_distributed()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", default="2x4")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--comms", default="hsdp,sharded")
    p.add_argument("overrides", nargs="*", default=["model.width=1024", "model.depth=7"])
    args = p.parse_args()
    import peers_profile

    from hybrid.app.checks import check_components, compose_train_config
    from hybrid.core.topology import Layout
    from hybrid.runtime.launch import launch_local

    layout = Layout.parse(args.layout)
    for comm in args.comms.split(","):
        overrides = [*args.overrides, f"comm={comm}", f"cluster.nnodes={layout.nnodes}",
                     f"cluster.nproc_per_node={layout.node_sizes[0]}", f"trainer.max_steps={args.steps}",
                     f"trainer.log_every={args.steps}"]
        check_components(compose_train_config(overrides))
        with tempfile.TemporaryDirectory() as run_dir:
            table = launch_local(layout, peers_profile.profiled_run, (overrides, run_dir), timeout_s=600)[0]
        print(f"### comm={comm}, {args.layout}, {args.steps} steps, rank 0, loopback: "
              f"python experiments/peers_profile.py --comms {comm} --steps {args.steps} {' '.join(args.overrides)}")
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
