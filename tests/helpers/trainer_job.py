"""The trainer's shared job: every training run of a layout inside one launch (workers start once), read by
the trainer's tests and by the peers' tests (torch HSDP and torch's hooks against plain DDP on the same runs)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from hybrid.app.checks import check_components, compose_train_config
from hybrid.app.config import TrainConfig
from hybrid.runtime.launch import launch_local

from helpers import train_workers
from helpers.once import once
from helpers.readme_example import write_example

__all__ = ["COMMS", "EXAMPLE", "PLANS", "ROOT", "job", "model_state", "settings", "checkpoint"]

ROOT = Path(tempfile.mkdtemp(prefix="hybrid-trainer-tests-"))


BASE = ["comm.bucket_mb=0.02", "comm.timeout_s=120", "optim.lr=0.1", "optim.warmup_steps=5", "trainer.max_steps=20",
        "trainer.log_every=10"]
# Unless a run picks another model and data: 3 buckets of this MLP (51.3 KiB).
MLP_ON_SYNTHETIC = ["model.width=64", "model.depth=3", f"data.root={ROOT / 'data'}", "data.num_samples=2048",
                    "data.batch_size=16"]
EXAMPLE = ROOT / "example"  # the package and configs of docs/your-model.md's worked example

COMMS = ["ddp", "flat", "hierarchical", "sharded"]
# Hugging Face's GPT2LMHeadModel (tied embeddings) on the Python docs' text that ships with CPython, byte-level.
GPT2_ON_TEXT = ["model=gpt2", "model.width=32", "model.depth=2", "model.heads=4", "data=text", "data.seq_len=32"]
# docs/your-model.md's worked example: frozen layer, BatchNorm, shared block, tied head, own dataset and loss.
MINE = ["model=mynet", "data=spirals", "loss=smoothed", "optim=adamw", "optim.lr=0.01", "data.batch_size=16"]
# Gradients copied out of DDP's buckets here (the other path of settle_buckets and of zero_grad).
HIERARCHICAL_BF16 = ["comm=hierarchical", "comm.inter_compression=bf16", "comm.grad_as_bucket_view=false"]
SHARDED_FP16 = ["comm=sharded", "comm.inter_compression=fp16"]
# comm=diloco. The algebra's exact case (H=1, outer SGD lr 1 without momentum, inner SGD without momentum) against
# plain DDP with that inner SGD; and H=8 with the paper's outer optimizer, every step's replicas checked (each node's
# workers every step, all four ranks after each outer step), straight and stopped at step 13, inside an interval.
PLAIN_SGD = ["optim.momentum=0"]
DILOCO_EXACT = ["comm=diloco", "comm.sync_every=1", "comm.outer_optim.lr=1.0", "comm.outer_optim.momentum=0",
                "comm.outer_optim.nesterov=false", *PLAIN_SGD]
DILOCO_H8 = ["comm=diloco", "comm.sync_every=8", "trainer.check_replicas_every=1", "trainer.checkpoint_every=4",
             "trainer.keep_checkpoints=10", "trainer.timeline=true", "trainer.timeline_steps=[7,9]"]
# Streaming: 2 fragments, each exchange overlapped with the next two inner steps, fp8 on the wire, sharded.
DILOCO_STREAMING = ["comm=diloco", "comm.sync_every=8", "comm.fragments=2", "comm.overlap=true", "comm.overlap_steps=2",
                    "comm.inter=sharded", "comm.inter_compression=fp8", "trainer.check_replicas_every=1"]
# comm.shard_optimizer (ZeRO-1 inside the node): AdamW with weight decay and clipping at 1.0 against plain DDP, and
# checkpoints across the two (stopped at step 13, resumed by the other); with SGD it steps exactly as its comm does
# unsharded (pieces of 2 KB: several shards per bucket), with the 16-bit hop too.
# comm=adaptive by a plan (the switch itself, at known steps): DiLoCo at H=3 after step 4, hierarchical with the
# 16-bit hop after 8, DiLoCo again after 12 (its outer momentum kept from the first phase, the 16-bit residuals kept
# for later), sharded with the 16-bit hop after 16; every step's replicas checked; stopped at 10 (between the DiLoCo
# phases: the kept state in the checkpoint) and at 14 (inside the second, residuals waiting), resumed; the timeline of
# steps 8-10 (the switch after step 8 is step 9's) in the straight run. With an empty
# plan it never switches: comm=hierarchical's run, and with the 16-bit mode alone, comm.inter_compression=bf16's.
ADAPTIVE_PLAN = ["comm=adaptive", "comm.adapt_every=0", "comm.sync_every=3", "trainer.check_replicas_every=1",
                 "trainer.checkpoint_every=4", "trainer.keep_checkpoints=10",
                 "comm.adapt_modes=[hierarchical,sharded,hierarchical+bf16,sharded+bf16,diloco]",
                 "comm.adapt_plan=[[4,diloco],[8,hierarchical+bf16],[12,diloco],[16,sharded+bf16]]"]
ADAPTIVE_RUNS = [("adaptive-plan", [*ADAPTIVE_PLAN, "trainer.timeline=true", "trainer.timeline_steps=[8,10]"])] + [
    (f"adaptive-plan-{stop}", [*ADAPTIVE_PLAN, *extra]) for stop in (10, 14)
    for extra in ([f"trainer.stop_after={stop}"], ["trainer.resume=true"])
] + [("adaptive-none", ["comm=adaptive", "comm.adapt_every=0", "comm.adapt_plan=[]"]),
      ("adaptive-none+bf16", ["comm=adaptive", "comm.adapt_every=0", "comm.adapt_plan=[]", "comm.grad_as_bucket_view=false",
                              "comm.adapt_modes=[hierarchical+bf16]"])]
# Its DiLoCo mode streamed (2 fragments, each exchange overlapped with the next inner step, fp8 on the wire): in at
# 4, out at 14 (an exchange in flight lands first); every step's replicas checked; stopped at 11 and resumed.
# The same phases unstreamed: the bytes the streamed one is held to.
ADAPTIVE_UNSTREAMED = ["comm=adaptive", "comm.adapt_every=0", "comm.sync_every=4", "trainer.check_replicas_every=1",
                       "trainer.checkpoint_every=4", "comm.adapt_modes=[hierarchical,diloco]",
                       "comm.adapt_plan=[[4,diloco],[14,hierarchical]]"]
ADAPTIVE_STREAMED = [*ADAPTIVE_UNSTREAMED, "comm.fragments=2", "comm.overlap=true", "comm.overlap_steps=1",
                     "comm.inter_compression=fp8"]
# The plan's run with comm.shard_optimizer (SGD with momentum: the shards' numbers are the whole state's), stopped
# at 14, inside the second DiLoCo phase (each node's workers' shards in the checkpoint), and resumed.
ADAPTIVE_ZERO = [*ADAPTIVE_PLAN, "comm.shard_optimizer=true"]
ADAPTIVE_RUNS += [("adaptive-plan-zero", ADAPTIVE_ZERO)] + [
    ("adaptive-plan-zero-14", [*ADAPTIVE_ZERO, extra]) for extra in ("trainer.stop_after=14", "trainer.resume=true")]
ADAPTIVE_RUNS += [("adaptive-streamed", ADAPTIVE_STREAMED), ("adaptive-unstreamed", ADAPTIVE_UNSTREAMED)] + [
    ("adaptive-streamed-11", [*ADAPTIVE_STREAMED, extra]) for extra in ("trainer.stop_after=11", "trainer.resume=true")]
ZERO = ["comm=sharded", "comm.shard_optimizer=true"]
ADAMW = ["optim=adamw", "optim.lr=0.001", "optim.weight_decay=0.1", "trainer.grad_clip_norm=1.0"]
ZERO_HALF = ROOT / "2x2" / "zero-adamw-13"
DDP_HALF = ROOT / "2x2" / "ddp-adamw-13"
ZERO_PLANS = [
    ("ddp-adamw", ["comm=ddp", *ADAMW]),
    ("zero-adamw", [*ZERO, *ADAMW]),
    ("zero-adamw-13", [*ZERO, *ADAMW, "trainer.stop_after=13"]),
    ("ddp-adamw-13", ["comm=ddp", *ADAMW, "trainer.stop_after=13"]),
    ("ddp-from-zero", ["comm=ddp", *ADAMW, f"trainer.resume={ZERO_HALF}"]),
    ("zero-from-ddp", [*ZERO, *ADAMW, f"trainer.resume={DDP_HALF}"]),
    ("zero-adamw-13", [*ZERO, *ADAMW, "trainer.resume=true"]),
    ("ddp-zero-redundancy", ["comm=ddp", "comm.shard_optimizer=true", *ADAMW]),  # torch's ZeroRedundancyOptimizer
    ("zero-sgd", [*ZERO, "comm.pipeline_chunk_mb=0.002"]),
    ("zero-hierarchical", ["comm=hierarchical", "comm.shard_optimizer=true"]),
    ("zero-auto", ["comm=auto", "comm.shard_optimizer=true"]),  # auto among hierarchical and sharded
    ("zero+fp16", [*ZERO, "comm.inter_compression=fp16"]),
]
# comm=diloco with comm.shard_optimizer: AdamW (weight decay, clipping) at H=4 for 24 steps against DiLoCo's own,
# every step's replicas checked; stopped at 14 (inside an interval: the nodes' inner shards differ) and resumed.
DILOCO_ADAMW = ["comm=diloco", "comm.sync_every=4", *ADAMW, "trainer.max_steps=24", "trainer.check_replicas_every=1",
                "trainer.checkpoint_every=4"]
DILOCO_ZERO = [*DILOCO_ADAMW, "comm.shard_optimizer=true"]
DILOCO_ZERO_PLANS = [("diloco-adamw", DILOCO_ADAMW), ("diloco-zero-adamw", DILOCO_ZERO)] + [
    ("diloco-zero-adamw-14", [*DILOCO_ZERO, extra]) for extra in ("trainer.stop_after=14", "trainer.resume=true")]
# trainer.compile: torch.compile'd DDP in three comms (DDP's buckets at 1 MiB, as torch's DDPOptimizer needs: one
# bucket of this MLP), each against its uncompiled run above; the first compiles, the others find dynamo's graph.
COMPILED = ["trainer.compile=true", "comm.bucket_mb=1"]
COMPILED_PLANS = [("hierarchical-compiled", ["comm=hierarchical", *COMPILED]),
                  ("sharded-compiled", ["comm=sharded", *COMPILED]),
                  ("diloco-adamw-compiled", [*DILOCO_ADAMW, *COMPILED])]
# optim.no_decay (biases and norm weights without weight decay): AdamW in every comm against comm=ddp's, ZeRO's
# stopped at 13 and resumed; SGD's exact DiLoCo case (H=1) against DDP's with that SGD and weight decay.
NO_DECAY = [*ADAMW, "optim.no_decay=true"]
SGD_DECAY = [*PLAIN_SGD, "optim.weight_decay=0.1", "optim.no_decay=true"]
NO_DECAY_PLANS = [(f"{name}-nodecay", [*comm, *NO_DECAY]) for name, comm in (
    ("ddp", ["comm=ddp"]), ("hierarchical", ["comm=hierarchical"]), ("zero", ZERO), ("hsdp", ["comm=hsdp"]),
    ("ddp-zero-redundancy", ["comm=ddp", "comm.shard_optimizer=true"]))] + [
    ("zero-nodecay-13", [*ZERO, *NO_DECAY, *extra]) for extra in (["trainer.stop_after=13"], ["trainer.resume=true"])
] + [("ddp-sgd-nodecay", ["comm=ddp", *SGD_DECAY]), ("diloco-exact-nodecay", [*DILOCO_EXACT, *SGD_DECAY])]
PLANS = {
    "2x2": [(c, [f"comm={c}"]) for c in COMMS] + ZERO_PLANS + DILOCO_ZERO_PLANS + COMPILED_PLANS + NO_DECAY_PLANS + [
        ("ddp-plain-sgd", ["comm=ddp", *PLAIN_SGD]),
        ("diloco-exact", DILOCO_EXACT),
        ("diloco-exact-sharded", [*DILOCO_EXACT, "comm.inter=sharded"]),
        ("diloco-h8", DILOCO_H8),
        ("diloco-h8-resumed", [*DILOCO_H8, "trainer.stop_after=13"]),
        ("diloco-h8-resumed", [*DILOCO_H8, "trainer.resume=true"]),
        *ADAPTIVE_RUNS,
        ("diloco-streaming", DILOCO_STREAMING),
        ("diloco-streaming-resumed", [*DILOCO_STREAMING, "trainer.stop_after=9"]),
        ("diloco-streaming-resumed", [*DILOCO_STREAMING, "trainer.resume=true"]),
        ("straight", ["trainer.max_steps=40"]),
        ("resumed", ["trainer.max_steps=40", "trainer.stop_after=20"]),
        ("resumed", ["trainer.max_steps=40", "trainer.resume=true"]),
        ("accum", ["comm=hierarchical", "trainer.grad_accum_steps=2"]),
        ("hierarchical+bf16", HIERARCHICAL_BF16),
        ("hierarchical+bf16-resumed", [*HIERARCHICAL_BF16, "trainer.stop_after=10"]),
        ("hierarchical+bf16-resumed", [*HIERARCHICAL_BF16, "trainer.resume=true"]),
        ("sharded+fp16", SHARDED_FP16),
        ("sharded+fp16-resumed", [*SHARDED_FP16, "trainer.stop_after=10"]),
        ("sharded+fp16-resumed", [*SHARDED_FP16, "trainer.resume=true"]),
        ("auto", ["comm=auto"]),
        # Clipping of the averaged gradients, bf16 autocast, DDP's find_unused_parameters (the trainer's own keys).
        ("clip-ddp", ["comm=ddp", "trainer.grad_clip_norm=0.05"]),
        ("clip-hierarchical", ["comm=hierarchical", "trainer.grad_clip_norm=0.05"]),
        ("bf16-ddp", ["comm=ddp", "trainer.precision=bf16"]),
        ("bf16-sharded", ["comm=sharded", "comm.find_unused_parameters=true", "trainer.precision=bf16"]),
        # timeline.json of steps 3..6, and of the default window with flat's buckets in flight at once.
        ("timeline-hierarchical", ["comm=hierarchical", "trainer.timeline=true", "trainer.timeline_steps=[3,6]"]),
        ("timeline-flat", ["comm=flat", "trainer.timeline=true"]),
    ] + [(f"gpt2-{c}", [f"comm={c}", *GPT2_ON_TEXT]) for c in ("ddp", "hierarchical", "sharded")]
      + [(f"mine-{c}", [f"comm={c}", *MINE]) for c in COMMS]
      + [("mine-hierarchical-resumed", ["comm=hierarchical", *MINE, *extra])
         for extra in (["trainer.stop_after=10"], ["trainer.resume=true"])]
      + [("mine-sharded+bf16", [*MINE, "comm=sharded", "comm.inter_compression=bf16"]),
         ("mine-auto", [*MINE, "comm=auto"])]
      # The peers: torch FSDP2 as HSDP, and torch's own DDP hooks (the bf16 one refuses gloo).
      + [("hsdp", ["comm=hsdp"]),
         ("hsdp-resumed", ["comm=hsdp", "trainer.stop_after=10", "trainer.check_replicas_every=5"]),
         ("hsdp-resumed", ["comm=hsdp", "trainer.resume=true", "trainer.check_replicas_every=5"]),
         ("hsdp-accum", ["comm=hsdp", "trainer.grad_accum_steps=2"]),
         ("hsdp-clip", ["comm=hsdp", "trainer.grad_clip_norm=0.05"]),
         ("gpt2-hsdp", ["comm=hsdp", *GPT2_ON_TEXT]),
         ("mine-hsdp", ["comm=hsdp", *MINE]),
         ("ddp+fp16-hook", ["comm=ddp", "comm.torch_hook=fp16"]),
         # One bucket: torch's PowerSGD hook aborts on gloo with more (hybrid.app.checks.check_powersgd_buckets).
         ("ddp+powersgd-hook", ["comm=ddp", "comm.torch_hook=powersgd", "comm.powersgd_warmup_steps=5",
                                "comm.bucket_mb=25"])],
    "4x2": [(c, [f"comm={c}"]) for c in COMMS] + ZERO_PLANS[:2] + [("zero-sgd", ZERO)] + [
        (f"{c}-resumed", [f"comm={c}", *resume])
        for c in ("ddp", "sharded") for resume in (["trainer.stop_after=10"], ["trainer.resume=true"])
    ],
    # Three ranks: plain DDP divides by a world size that is not a power of two.
    "3x1": [(c, [f"comm={c}"]) for c in ("ddp", "hierarchical")] + [
        (f"{c}-resumed", [f"comm={c}", *resume])
        for c in ("ddp", "hierarchical") for resume in (["trainer.stop_after=10"], ["trainer.resume=true"])
    ],
}


def settings(layout: str, overrides: list[str]) -> TrainConfig:
    """What ``python -m hybrid.train --config-dir <example>/myconf`` would run with these overrides."""
    _example()
    nnodes, nproc = map(int, layout.split("x"))
    own_data = any(o.startswith(("model=", "data=")) for o in overrides)
    return compose_train_config([*BASE, *([] if own_data else MLP_ON_SYNTHETIC), f"cluster.nnodes={nnodes}",
                                 f"cluster.nproc_per_node={nproc}", *overrides], user_dirs=[EXAMPLE / "myconf"])


def _example() -> None:
    """The worked example's package and configs under EXAMPLE, once per process."""
    if not EXAMPLE.is_dir():
        write_example(EXAMPLE)
        sys.path.insert(0, str(EXAMPLE))  # mypkg, for this process and the launched workers (they inherit it)


@once
def job(layout: str) -> tuple[Path, dict]:
    _example()
    plan = [(name, settings(layout, overrides)) for name, overrides in PLANS[layout]]
    check_components(plan[0][1])  # generate the synthetic data once, before the ranks start
    root = ROOT / layout
    return root, launch_local(plan[0][1].layout, train_workers.runs, (str(root), plan), timeout_s=300)[0]


def model_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


def checkpoint(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
