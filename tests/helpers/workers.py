"""Code that runs on every rank of a ``launch_local`` job in the tests.

One job per layout runs several named cases (starting workers costs seconds
each on this machine, so a layout is launched once). Every case returns plain
data: lists of failure descriptions, digests, numbers. The tests assert on it.
"""

from __future__ import annotations

import copy
import hashlib
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.core.comm import (
    ALGORITHM_CLASSES,
    AutoCommunicator,
    CommError,
    CommGroups,
    PhaseCounters,
    make_communicator,
    register_comm_hook,
)
from hybrid.core.comm.counters import allreduce_bytes, rooted_bytes
from hybrid.core.costmodel import Level, Model
from hybrid.core.topology import Layout, Topology, discover_topology
from hybrid.runtime.distributed import init_distributed, shutdown_distributed

from helpers.zero_workers import case_zero

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SIZES = (0, 1, 7, 2**20 + 3)


def digest(tensors: list[torch.Tensor] | torch.Tensor) -> str:
    """sha256 of the exact bits, so equality means bit-identical."""
    h = hashlib.sha256()
    for t in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def same_on_all_ranks(value: Any) -> bool:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return all(v == gathered[0] for v in gathered)


def flat_reference(x: torch.Tensor) -> torch.Tensor:
    """torch's own flat all-reduce (sum) over the default group, then / world."""
    ref = x.clone()
    dist.all_reduce(ref)
    return ref.div_(dist.get_world_size())


def lowp_atol(dtype: torch.dtype, world: int, max_abs: float) -> float:
    # Recursive summation of `world` terms rounds at most `world` times, each
    # by eps * (partial sum) <= eps * max|x| after pre-division.
    return (world + 1) * torch.finfo(dtype).eps * max(max_abs, 1.0)


def case_collectives(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    failures: list[str] = []
    runs_as: dict[str, str] = {}
    digests: list[str] = []
    world = topo.world_size
    for alg in ALGORITHM_CLASSES:
        comm = make_communicator(alg, groups)
        runs_as[alg] = comm.name
        for dtype in DTYPES:
            for size in params.get("sizes", SIZES):
                tag = f"{alg}/{str(dtype)[6:]}/n={size}"
                gen = torch.Generator().manual_seed(7919 * topo.rank + size)
                hi = 16 if dtype == torch.bfloat16 else 20
                integers = torch.randint(-hi, hi + 1, (size,), generator=gen).to(dtype)
                normal = torch.randn(size, generator=gen, dtype=torch.float64).to(dtype)
                for kind, x in (("int", integers), ("normal", normal)):
                    ref = flat_reference(x)
                    got = comm.all_reduce_mean_(x.clone())
                    digests.append(digest(got))
                    try:
                        if dtype in (torch.float32, torch.float64) and kind == "int":
                            assert torch.equal(got, ref), "not bit-identical to flat all-reduce"
                        elif dtype in (torch.float32, torch.float64):
                            torch.testing.assert_close(got, ref)
                        else:
                            # The bound depends on the largest input on *any* rank.
                            max_abs = x.abs().max().double() if size else torch.zeros((), dtype=torch.float64)
                            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX)
                            torch.testing.assert_close(
                                got.double(), ref.double(), rtol=0,
                                atol=lowp_atol(dtype, world, float(max_abs)),
                            )
                    except AssertionError as exc:
                        failures.append(f"{tag}/{kind} rank {topo.rank}: {str(exc)[:300]}")
        # Non-contiguous input is averaged in place too.
        x = torch.arange(24, dtype=torch.float32).reshape(6, 4).t() * (topo.rank + 1)
        ref = flat_reference(x.contiguous())
        got = comm.all_reduce_mean_(x)
        if got is not x or not torch.equal(x, ref):
            failures.append(f"{alg}/non-contiguous rank {topo.rank}: wrong result or not in place")
        # fp16 where a plain summing all-reduce overflows: the mean must not.
        if world > 1:
            big = torch.full((5,), 40000.0, dtype=torch.float16)
            plain = big.clone()
            dist.all_reduce(plain)
            got = comm.all_reduce_mean_(big.clone())
            if not torch.isinf(plain).all():
                failures.append("fp16 overflow probe: plain sum unexpectedly finite")
            if not torch.isfinite(got).all() or (got.double() - 40000).abs().max() > lowp_atol(
                torch.float16, world, 40000
            ):
                failures.append(f"{alg}/fp16 overflow rank {topo.rank}: got {got.tolist()}")
    # Tiny pipeline pieces (3 fp32 / 1.5 fp64 elements): many pieces, shards of 0 or 1 element.
    for alg in ("hierarchical", "sharded"):
        comm = make_communicator(alg, groups, chunk_bytes=12)
        for dtype in (torch.float32, torch.float64):
            for size in (0, 1, 7, 100):
                gen = torch.Generator().manual_seed(31 * topo.rank + size)
                x = torch.randint(-20, 21, (size,), generator=gen).to(dtype)
                got = comm.all_reduce_mean_(x.clone())
                digests.append(digest(got))
                if not torch.equal(got, flat_reference(x)):
                    failures.append(f"{alg}/chunk12/{dtype}/n={size} rank {topo.rank}: differs from flat all-reduce")
    # Flat's split path (head + 1/8 tail, all-reduced together) normally starts at
    # 32 MiB; lowered here so small tensors take it.
    import hybrid.core.comm.flat as flat_module

    # Both ways flat averages: in the transport (gloo's AVG) and by our own division after a SUM
    # (NCCL, or a torch without gloo AVG), each also through the DDP hook's asynchronous path.
    saved = flat_module.SPLIT_MIN_BYTES
    try:
        for transport_avg, split_min in ((True, 16), (False, 16), (False, 2**40)):
            flat_module.SPLIT_MIN_BYTES = split_min
            comm = make_communicator("flat", groups)
            comm.transport_avg = transport_avg
            for dtype in (torch.float32, torch.float64):
                for size in (5, 9, 100, 1001):
                    gen = torch.Generator().manual_seed(17 * topo.rank + size)
                    x = torch.randint(-20, 21, (size,), generator=gen).to(dtype)
                    x[0] = 2**20 + 1  # an odd sum: not divisible by most world sizes
                    ref = flat_reference(x)
                    got = comm.all_reduce_mean_(x.clone())
                    started = comm.start_mean_(x.clone()).wait()
                    digests.extend([digest(got), digest(started)])
                    for path, result in (("sync", got), ("hook", started)):
                        if not torch.equal(result, ref):
                            failures.append(f"flat/split>={split_min}/avg={transport_avg}/{path}/{dtype}/n={size} rank "
                                            f"{topo.rank}: differs from flat all-reduce")
    finally:
        flat_module.SPLIT_MIN_BYTES = saved
    if not same_on_all_ranks(digests):
        failures.append(f"rank {topo.rank}: results differ between ranks")
    return {"failures": failures, "runs_as": runs_as}


def case_counters(topo: Topology, groups: CommGroups, params: dict) -> list[str]:
    """Each phase reports the time and the bytes this rank sent, per the schedule."""
    failures: list[str] = []
    numel = 1000
    nbytes = numel * 4
    local, nnodes, world = topo.local_world_size, topo.nnodes, topo.world_size
    for alg in ALGORITHM_CLASSES:
        counters = PhaseCounters()
        comm = make_communicator(alg, groups, counters)
        comm.all_reduce_mean_(torch.ones(numel))
        snap = counters.snapshot(reset=True)
        if comm.name == "flat":
            expected = {"flat_allreduce": allreduce_bytes(nbytes, world)}
        elif comm.name == "hierarchical":
            expected = {
                "intra_reduce": rooted_bytes(nbytes, local),
                "inter_allreduce": allreduce_bytes(nbytes, nnodes) if topo.is_leader else 0,
                "intra_broadcast": rooted_bytes(nbytes, local),
            }
        else:
            shard = torch.tensor_split(torch.ones(numel), local)[topo.local_rank].nbytes
            expected = {
                "intra_reduce": rooted_bytes(nbytes, local),
                "inter_allreduce": allreduce_bytes(shard, nnodes),
                "intra_broadcast": rooted_bytes(nbytes, local),
            }
        for phase, stats in snap.items():
            want = expected.get(phase, 0)
            if stats.bytes != want:
                failures.append(f"{alg} {phase} rank {topo.rank}: bytes {stats.bytes} != {want}")
            if stats.calls and stats.seconds <= 0:
                failures.append(f"{alg} {phase} rank {topo.rank}: no time recorded")
        if any(s.calls for s in counters.snapshot().values()):
            failures.append(f"{alg}: snapshot(reset=True) did not reset")
    return failures


class Net(nn.Module):
    """An MLP with a branch that forward never uses (DDP's find_unused_parameters path)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *[m for _ in range(depth) for m in (nn.Linear(width, width), nn.Tanh())]
        )
        self.head = nn.Linear(width, 4)
        self.unused = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def train_ddp(
    comm_name: str, groups: CommGroups, base: nn.Module, steps: int, width: int,
    bucket_cap_mb: float, seed: int, inter_compression: str = "none", comm: Any = None,
) -> dict[str, Any]:
    """SGD on rank-specific data; each step accumulates a no_sync micro-batch.

    ``comm``: an already built communicator to hook in (else one is made from ``comm_name``)."""
    model = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, find_unused_parameters=True)
    state = None
    if comm_name != "ddp":
        comm = comm or make_communicator(comm_name, groups, inter_compression=inter_compression)
        state = register_comm_hook(model, comm)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, width, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad(set_to_none=True)
        with model.no_sync():
            nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
        nn.functional.cross_entropy(model(x[8:]), y[8:]).backward()
        opt.step()
    buckets = state.buckets_per_step if state else None
    if state is not None:
        state.close()
    params = [p.detach().clone() for p in model.module.parameters()]
    return {"params": params, "buckets": buckets}


def case_ddp(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    steps, width, depth = params.get("steps", 10), params.get("width", 64), params.get("depth", 10)
    cap = params.get("bucket_cap_mb", 0.01)
    torch.manual_seed(0)
    base = Net(width, depth)
    comms = params.get("comms", ["ddp", *ALGORITHM_CLASSES])
    runs = {name: train_ddp(name, groups, base, steps, width, cap, seed=1) for name in comms}
    out: dict[str, Any] = {}
    for name, run in runs.items():
        result = {
            "buckets": run["buckets"],
            "identical_across_ranks": same_on_all_ranks(digest(run["params"])),
        }
        if "ddp" in runs and name != "ddp":
            try:
                for got, ref in zip(run["params"], runs["ddp"]["params"]):
                    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
                result["matches_ddp"] = "yes"
            except AssertionError as exc:
                result["matches_ddp"] = str(exc)[:400]
            moved = max((p - q).abs().max().item() for p, q in zip(run["params"], base.parameters()))
            result["moved"] = moved
        out[name] = result
    return out


def case_bad_layout(topo: Topology, groups: CommGroups, params: dict) -> str:
    nnodes, nproc = params.get("declared", (3, 2))
    try:
        discover_topology(expected=Layout.uniform(nnodes, nproc))
    except ValueError as exc:
        return str(exc)
    return "no error"


def case_timeout(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """The last rank never joins; everyone else must get an error, not a hang.

    Every algorithm on groups of its own, all three at once (one thread each; separate groups are separate
    transports), so the case waits out the timeouts once rather than three times. Runs last in a job: it leaves
    the groups it broke behind.
    """
    import threading

    timeout_s = params.get("comm_timeout_s", 2.0)
    silent = topo.world_size - 1
    comms = {alg: make_communicator(alg, CommGroups.build(topo, timeout_s=timeout_s)) for alg in ALGORITHM_CLASSES}
    out: dict[str, Any] = {}

    def attempt(alg: str) -> None:
        start = time.monotonic()
        try:
            comms[alg].all_reduce_mean_(torch.ones(1000))
            out[alg] = {"raised": False}
        except CommError as exc:
            out[alg] = {"raised": True, "elapsed": time.monotonic() - start, "message": str(exc)}

    if topo.rank != silent:
        threads = [threading.Thread(target=attempt, args=(alg,)) for alg in comms]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(4 * timeout_s + 30)
    dist.barrier()  # default group: meets again once the others have given up
    return out


def case_guard(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """The 16-bit hop's guard, per algorithm: checked every 2nd use of its first piece, four all-reduces of
    ordinary values give two checks within fp16's rounding and no fall-back; values beyond fp16's range give
    an infinite error at the first check and a fall-back, after which the next all-reduce is the uncompressed
    communicator's, bit for bit. Only ranks that cross nodes compress (every sharded rank, hierarchical's leaders)."""
    out: dict[str, Any] = {"crosses": topo.is_leader}
    for alg in ("hierarchical", "sharded"):
        comm = make_communicator(alg, groups, chunk_bytes=4096, inter_compression="fp16")
        comm.compressor.guard(2, 0.05)
        for step in range(4):
            x = torch.randn(10007, generator=torch.Generator().manual_seed(31 * topo.rank + step))
            comm.all_reduce_mean_(x, key=("guard", 0))
        overflowing = make_communicator(alg, groups, chunk_bytes=4096, inter_compression="fp16")
        overflowing.compressor.guard(1, 0.05)
        big = torch.randn(10007, generator=torch.Generator().manual_seed(topo.rank)) * 1e6
        overflowing.all_reduce_mean_(big, key=("guard", 0))
        x = torch.randn(10007, generator=torch.Generator().manual_seed(97 + topo.rank))
        after = overflowing.all_reduce_mean_(x.clone(), key=("guard", 0))
        plain = make_communicator(alg, groups, chunk_bytes=4096).all_reduce_mean_(x.clone(), key=("guard", 0))
        out[alg] = {"checks": comm.compressor.checks, "fell_back": comm.compressor.fell_back,
                    "overflow_checks": overflowing.compressor.checks, "overflow_fell_back": overflowing.compressor.fell_back,
                    "then_uncompressed": torch.equal(after, plain)}
    return out


def case_compression(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """The inter-node hop in bf16/fp16: identical bits on every rank, within the wire's rounding of
    torch's flat mean, half the inter-node bytes; and through the DDP hook, training that stays with DDP's."""
    failures: list[str] = []
    digests: list[str] = []
    world, local, nnodes = topo.world_size, topo.local_world_size, topo.nnodes
    for alg in ("hierarchical", "sharded"):
        for kind, wire in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            comm = make_communicator(alg, groups, chunk_bytes=4096, inter_compression=kind)
            for size in (1, 7, 10007):
                gen = torch.Generator().manual_seed(101 * topo.rank + size)
                x = torch.randn(size, generator=gen)
                ref = flat_reference(x)
                got = comm.all_reduce_mean_(x.clone(), key=("t", size))
                digests.append(digest(got))
                largest = x.abs().max()
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
                # Each node's share (at most local * max|x| / world) is rounded once to the wire dtype, and
                # each of the nnodes - 1 additions of the all-reduce rounds once more.
                atol = 2 * nnodes * torch.finfo(wire).eps * local * float(largest) / world
                try:
                    torch.testing.assert_close(got, ref, rtol=0, atol=atol)
                except AssertionError as exc:
                    failures.append(f"{alg}/{kind}/n={size} rank {topo.rank}: {str(exc)[:300]}")
            counters = PhaseCounters()
            comm = make_communicator(alg, groups, counters, inter_compression=kind)
            comm.all_reduce_mean_(torch.ones(1000))
            sent = counters.snapshot()["inter_allreduce"].bytes
            if alg == "hierarchical":
                want = allreduce_bytes(1000 * 2, nnodes) if topo.is_leader else 0
            else:
                want = allreduce_bytes(torch.tensor_split(torch.ones(1000), local)[topo.local_rank].numel() * 2, nnodes)
            if sent != want:
                failures.append(f"{alg}/{kind} rank {topo.rank}: inter-node bytes {sent} != {want}")
    if not same_on_all_ranks(digests):
        failures.append(f"rank {topo.rank}: compressed results differ between ranks")
    steps, width, depth = params.get("steps", 10), params.get("width", 64), params.get("depth", 10)
    torch.manual_seed(0)
    base = Net(width, depth)
    runs = {name: train_ddp(name.split("/")[0], groups, base, steps, width, 0.01, seed=1,
                            inter_compression=name.split("/")[1] if "/" in name else "none")
            for name in ("ddp", "hierarchical/bf16", "sharded/fp16")}
    training: dict[str, Any] = {}
    for name in ("hierarchical/bf16", "sharded/fp16"):
        run = runs[name]
        gap = max((p - q).abs().max().item() for p, q in zip(run["params"], runs["ddp"]["params"]))
        moved = max((p - q).abs().max().item() for p, q in zip(runs["ddp"]["params"], base.parameters()))
        training[name] = {"identical_across_ranks": same_on_all_ranks(digest(run["params"])),
                          "gap_to_ddp": gap, "ddp_moved": moved}
    return {"failures": failures, "training": training}


def case_auto(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """comm=auto: a calibration every rank agrees on, torch's flat mean to the bit, and (with a model
    that sends small buckets flat and large ones hierarchical) DDP training that matches plain DDP."""
    import json

    failures: list[str] = []
    comm = make_communicator("auto", groups)
    report = comm.report()
    if not same_on_all_ranks(json.dumps([report["model"], report["nics_per_node"]], sort_keys=True)):
        failures.append(f"rank {topo.rank}: calibrated model differs between ranks: {report['model']}")
    # Small buckets pay the intra level's 1 ms per step twice; above ~8 KB flat's 1.5x the bytes on the
    # slow link cost more (2x2; on uneven 3,1 the threshold differs but both choices still occur).
    forced = Model(Level(1e-3, 0.0), Level(0.0, 4e-3 / 8192))
    counters = PhaseCounters()
    split = AutoCommunicator(groups, counters, model=forced)
    for size in (1, 7, 2**20 + 3):
        x = torch.randint(-50, 50, (size,), generator=torch.Generator().manual_seed(7 * topo.rank + size)).float()
        for name, c in (("calibrated", comm), ("forced", split)):
            got = c.all_reduce_mean_(x.clone())
            if digest(got) != digest(flat_reference(x)):
                failures.append(f"{name} auto, {size} values, rank {topo.rank}: differs from torch's flat mean")
    chosen = {d["bytes"]: d["chosen"] for d in split.report()["decisions"]}
    if chosen != {4: "flat", 28: "flat", (2**20 + 3) * 4: "hierarchical"}:
        failures.append(f"rank {topo.rank}: forced model chose {chosen}")
    seconds = counters.snapshot()
    if not (seconds["flat_allreduce"].bytes > 0 and (seconds["intra_reduce"].bytes > 0 or seconds["inter_allreduce"].bytes > 0)):
        failures.append(f"rank {topo.rank}: both algorithms should have run: {seconds}")
    steps, width, depth = params.get("steps", 10), params.get("width", 64), params.get("depth", 10)
    torch.manual_seed(0)
    base = Net(width, depth)
    hooked = AutoCommunicator(groups, model=forced)
    ref = train_ddp("ddp", groups, base, steps, width, 0.01, seed=1)
    run = train_ddp("auto", groups, base, steps, width, 0.01, seed=1, comm=hooked)
    bucket_choices = sorted({d["chosen"] for d in hooked.report()["decisions"]})
    try:
        for got, want in zip(run["params"], ref["params"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        matches = "yes"
    except AssertionError as exc:
        matches = str(exc)[:400]
    return {"failures": failures, "model": report["model"], "candidates": report["candidates"],
            "link_probe": report["link_probe"],
            "bucket_choices": bucket_choices, "matches_ddp": matches,
            "identical_across_ranks": same_on_all_ranks(digest(run["params"]))}


class _WaitForAFinishedBucket(torch.autograd.Function):
    """Identity whose backward waits until some bucket of this backward has finished reducing.

    Placed after the first layer, its backward runs before that layer's
    gradients exist, so the bucket holding them has not been handed to the hook
    yet: a communicator that overlaps lets an earlier bucket finish meanwhile; one
    that defers communication to the end of backward makes it wait out
    ``timeout_s`` (then it lets backward go on, and later steps do not wait, so a
    regression fails the test instead of hanging the job)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, gate: "_Gate") -> torch.Tensor:
        ctx.gate = gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.gate.wait()
        return grad, None


class _Gate:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.state: Any = None
        self.since: float | None = None  # when the gated backward's step began; None: let backward pass
        self.seen: list[bool] = []

    def wait(self) -> None:
        if self.since is None:
            return
        if False in self.seen:  # one miss fails the test: later steps need not wait it out again
            self.seen.append(False)
            return
        deadline = time.perf_counter() + self.timeout_s
        while time.perf_counter() < deadline:
            # Copy: DDP appends traces from this thread only, but the comm thread sets .finished.
            if any(t.finished and t.submitted >= self.since for t in list(self.state.traces)[-64:]):
                self.seen.append(True)
                return
            time.sleep(0.001)
        self.seen.append(False)


class GatedNet(Net):
    def __init__(self, width: int, depth: int, gate: _Gate) -> None:
        super().__init__(width, depth)
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _WaitForAFinishedBucket.apply(self.body[0](x), self.gate)
        return self.head(self.body[1:](h))


def case_overlap(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """Per comm and step: whether an earlier bucket finished reducing before backward produced the last one."""
    steps, width, depth = params.get("steps", 4), params.get("width", 32), params.get("depth", 8)
    out: dict[str, Any] = {}
    for comm_name in params.get("comms", list(ALGORITHM_CLASSES)):
        gate = _Gate(params.get("timeout_s", 30.0))  # generous: it returns as soon as a bucket is done
        torch.manual_seed(0)
        model = DDP(GatedNet(width, depth, gate), bucket_cap_mb=params.get("bucket_cap_mb", 0.004),
                    find_unused_parameters=True)
        gate.state = register_comm_hook(model, make_communicator(comm_name, groups))
        gen = torch.Generator().manual_seed(1 + dist.get_rank())
        for _ in range(steps):
            x = torch.randn(8, width, generator=gen)
            model.zero_grad(set_to_none=True)
            gate.since = time.perf_counter()
            model(x).square().mean().backward()
            gate.since = None
        out[comm_name] = {"seen": gate.seen, "buckets": gate.state.buckets_per_step}
        gate.state.close()
    return out


def case_clock(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """Clock alignment to rank 0: as measured (all ranks share this machine's clock: the true offset is 0), and
    with rank 1's clock made to run 5 s ahead (the true offset is then -5 s)."""
    import types

    from hybrid.core import clock

    same = clock.align_to_rank0()
    real = time.perf_counter
    shifted = 5.0 if topo.rank == 1 else 0.0
    clock.time = types.SimpleNamespace(perf_counter=lambda: real() + shifted)  # what align_to_rank0 reads
    try:
        ahead = clock.align_to_rank0()
    finally:
        clock.time = time
    return {"offset_s": same.offset_s, "error_s": same.error_s, "ahead_offset_s": ahead.offset_s,
            "ahead_error_s": ahead.error_s}


def case_profiler(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """Under a user's torch.profiler, every algorithm's phases show up as hybrid::<phase> ranges (the DDP hook's
    flat path as one range per bucket, issue to completion; the others' phases run on the communication thread,
    which the profiler records with profile_all_threads)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    names: dict[str, list[str]] = {}
    for alg in ("flat", "hierarchical", "sharded"):
        comm = make_communicator(alg, groups)
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4)), bucket_cap_mb=0.001)
        hook = register_comm_hook(model, comm)
        try:
            with profile(activities=[ProfilerActivity.CPU],
                         experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
                model(torch.randn(8, 32)).sum().backward()
        finally:
            hook.close()
        names[alg] = sorted({e.key for e in prof.key_averages() if e.key.startswith("hybrid::")})
    return names


def _diloco_run(topo: Topology, groups: CommGroups, steps: int, sync_every: int, inter: str | None,
                outer: Any = None, momentum: float = 0.0, stop_at: int = 0, fragments: int = 1,
                compression: str = "none", overlap: bool = False, piece_bytes: int | None = None) -> dict[str, Any]:
    """Train a small MLP ``steps`` inner steps on this rank's own batches: gradients averaged inside the node
    every step, and OuterSync across nodes every ``sync_every`` (``inter`` None: plain data parallel, gradients
    averaged over every rank, the reference). ``stop_at``: rebuild model, optimizers and OuterSync from their
    state dicts after that step, as a resume does. Returns the digest of the weights (and of the global weights)
after every step, and of the weights after ``OuterSync.finish``."""

    from hybrid.core.diloco import OuterSync, default_outer_optimizer

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        sync = None if inter is None else OuterSync(model.parameters(), groups, sync_every=sync_every, inter=inter,
                                                     outer_optimizer=outer or default_outer_optimizer,
                                                     fragments=fragments, compression=compression,
                                                     overlap=overlap,
                                                     **({"piece_bytes": piece_bytes} if piece_bytes else {}))
        return model, inner, sync

    model, inner, sync = build()
    batches = torch.Generator().manual_seed(1000 + topo.rank)
    digests, global_digests, owned_digests, weights = [], [], [], None
    for step in range(1, steps + 1):
        x, y = torch.randn(8, 16, generator=batches), torch.randint(0, 4, (8,), generator=batches)
        inner.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            group, size = (groups.intra, topo.local_world_size) if sync else (None, topo.world_size)
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(size)
        inner.step()
        if sync:
            sync.step(step)
        params = list(model.parameters())
        digests.append([digest([params[i] for i in run]) for run in sync.fragments] if sync and fragments > 1
                       else digest(params))
        global_digests.append(digest(sync.global_params) if sync else None)
        owned_digests.append(digest([params[i] for i in sync.owned]) if sync else None)
        if step == stop_at:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(inner.state_dict()),
                     copy.deepcopy(sync.state_dict()) if sync else None)
            model, inner, sync = build()
            model.load_state_dict(saved[0])
            inner.load_state_dict(saved[1])
            if sync:
                sync.load_state_dict(saved[2])
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    syncs = sync.syncs if sync else 0
    if sync:
        sync.finish(steps)
    return {"digests": digests, "global_digests": global_digests, "owned_digests": owned_digests,
            "weights": weights.tolist(), "owned": sync.owned if sync else None,
            "syncs": syncs, "bytes_per_sync": sync.bytes_per_sync if sync else 0,
            "finished": digest(list(model.parameters())), "identical_everywhere": bool(sync and sync.identical_everywhere)}


def case_diloco(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """DiLoCo's outer loop (hybrid.core.diloco): the algebra's exact case against plain data parallel (H=1, outer
    SGD lr 1 without momentum, inner SGD), both exchanges; and H=8 with the paper's outer optimizer, straight and
    resumed after step 13."""
    import functools

    steps = params.get("steps", 20)
    exact_outer = functools.partial(torch.optim.SGD, lr=1.0)
    out = {"reference": _diloco_run(topo, groups, steps, 1, None)}
    for inter in ("hierarchical", "sharded"):
        out[f"exact_{inter}"] = _diloco_run(topo, groups, steps, 1, inter, outer=exact_outer)
        out[f"h8_{inter}"] = _diloco_run(topo, groups, steps, 8, inter, momentum=0.9)
        out[f"h8_pieces_{inter}"] = _diloco_run(topo, groups, steps, 8, inter, momentum=0.9, piece_bytes=1)
    out["h8_resumed"] = _diloco_run(topo, groups, steps, 8, "hierarchical", momentum=0.9, stop_at=13)
    out["h8_streaming"] = _diloco_run(topo, groups, steps, 8, "sharded", momentum=0.9, fragments=2)
    for inter in ("hierarchical", "sharded"):
        out[f"h8_fp8_{inter}"] = _diloco_run(topo, groups, steps, 8, inter, momentum=0.9, compression="fp8")
    for inter in ("hierarchical", "sharded"):
        out[f"h8_overlap_{inter}"] = _diloco_run(topo, groups, steps, 8, inter, momentum=0.9, overlap=True)
    # Stopped with an exchange in flight (sent at step 8, due at 9).
    out["h8_overlap_resumed"] = _diloco_run(topo, groups, steps, 8, "sharded", momentum=0.9, overlap=True, stop_at=8)
    return out


CASES: dict[str, Callable[[Topology, CommGroups, dict], Any]] = {
    "auto": case_auto,
    "compression": case_compression,
    "guard": case_guard,
    "collectives": case_collectives,
    "counters": case_counters,
    "ddp": case_ddp,
    "diloco": case_diloco,
    "ddp_long": case_ddp,
    "overlap": case_overlap,
    "bad_layout": case_bad_layout,
    "timeout": case_timeout,
    "clock": case_clock,
    "profiler": case_profiler,
    "zero": case_zero,
}


def run_cases(cases: list[str], params: dict[str, dict]) -> dict[str, Any]:
    """Entry point of every test job: set up once, run the named cases in order."""
    env = init_distributed(timeout_s=120)
    try:
        topo = discover_topology(env)
        torch.set_num_threads(1)
        groups = CommGroups.build(topo, timeout_s=120)
        out: dict[str, Any] = {"rank": env.rank, "node_sizes": topo.node_sizes, "seconds": {}}
        for name in cases:
            start = time.perf_counter()
            out[name] = CASES[name](topo, groups, params.get(name, {}))
            out["seconds"][name] = round(time.perf_counter() - start, 2)  # where a job's time goes
        return out
    finally:
        shutdown_distributed()
