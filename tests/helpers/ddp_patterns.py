"""DDP programs as users write them, each run with plain DDP and with hybrid's hook, on every rank of a job.

The shapes follow what torch's own DDP tests exercise (test/distributed/
algorithms/ddp_comm_hooks/test_ddp_hooks.py: a hook's result against plain
all-reduce; torch/testing/_internal/distributed/distributed_test.py: uneven
inputs under Join with tiny buckets, control flow that differs across ranks,
shared and unused parameters, static graphs, no_sync, SyncBatchNorm and
buffer broadcast), written afresh for small CPU models. Every pattern is run
once with plain DDP (the reference), once per algorithm with the hook, and
once with a hook that is wrong by a factor of 1.001, which the comparison
must catch. Each run starts from the same weights and reads the same data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
from collections.abc import Hashable, Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.core.comm import CommGroups, Communicator, HierarchicalCommunicator, make_communicator, register_comm_hook
from hybrid.core.topology import discover_topology
from hybrid.runtime.distributed import init_distributed, shutdown_distributed

VARIANTS = ("ddp", "flat", "hierarchical", "sharded", "broken")
STEPS = 5
WIDTH = 24
BUFFER_SYNC = "forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP).parameters \
    else "broadcast_buffers"
TINY_BUCKET_MB = 0.002  # 2 KB: a 24x24 layer's weight is 2.3 KB, so about one bucket per tensor


class ScaledHierarchical(HierarchicalCommunicator):
    """A broken hook: hierarchical's mean times 1.001. Every pattern's comparison must fail on it."""

    def _sum_(self, flat: torch.Tensor, divisor: int | None, key: Hashable) -> None:
        super()._sum_(flat, divisor, key)
        flat.mul_(1.001)


class Hooker:
    """Wraps modules in DDP for one variant: plain DDP, or DDP with one shared communicator's hook."""

    def __init__(self, variant: str, groups: CommGroups, chunk_bytes: int | None = None) -> None:
        self.variant = variant
        self.comm: Communicator | None = None
        options = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        if variant == "broken":
            self.comm = ScaledHierarchical(groups, **options)
        elif variant != "ddp":
            self.comm = make_communicator(variant, groups, **options)
        self.states: list[Any] = []

    def ddp(self, module: nn.Module, **kwargs: Any) -> DDP:
        kwargs.setdefault("bucket_cap_mb", TINY_BUCKET_MB)
        model = DDP(module, **kwargs)
        if self.comm is not None:
            self.states.append(register_comm_hook(model, self.comm))
        return model

    def mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over all ranks directly (not through DDP): the communicator's own
        ``all_reduce_mean_``, or torch's all-reduce for plain DDP."""
        if self.comm is not None:
            return self.comm.all_reduce_mean_(tensor)
        dist.all_reduce(tensor)
        return tensor.div_(dist.get_world_size())

    def buckets(self) -> int:
        """Buckets the hook averaged in the last backward, over all models (0 for plain DDP)."""
        return sum(state.buckets_per_step for state in self.states)

    def close(self) -> None:
        for state in self.states:
            state.close()


def mlp(width_in: int, width_out: int, depth: int = 3) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(width_in, WIDTH), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, width_out))


def batches(n: int, rows: int = 8, width: int = WIDTH, seed: int = 0) -> Iterator[torch.Tensor]:
    """Rank-specific data, the same for every variant."""
    gen = torch.Generator().manual_seed(seed + 1000 * dist.get_rank())
    for _ in range(n):
        yield torch.randn(rows, width, generator=gen)


def state_of(*models: DDP) -> list[torch.Tensor]:
    return [t.detach().clone() for m in models for t in (*m.module.parameters(), *m.module.buffers())]


def sgd(*models: DDP, lr: float = 0.2, momentum: float = 0.0) -> torch.optim.Optimizer:
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def fit(model: DDP, opt: torch.optim.Optimizer, data: Iterator[torch.Tensor]) -> list[torch.Tensor]:
    """The plain step, one per batch: mean squared output, backward, SGD; the final state."""
    for x in data:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return state_of(model)


# The patterns. Each builds its models through ``h.ddp`` and returns the final parameters and buffers.

def several_models_in_one_backward(h: Hooker) -> list[torch.Tensor]:
    """A GAN's chain (the generator's output goes through the discriminator) and a third model beside it,
    all three DDP-wrapped and reduced in one backward, with many buckets each."""
    torch.manual_seed(0)
    gen, disc, side = h.ddp(mlp(WIDTH, WIDTH)), h.ddp(mlp(WIDTH, 1)), h.ddp(mlp(WIDTH, 1))
    opt = sgd(gen, disc, side)
    for x in batches(STEPS):
        opt.zero_grad()
        (disc(gen(x)).square().mean() + side(x).square().mean()).backward()
        opt.step()
    return state_of(gen, disc, side)


def uneven_inputs_under_join(h: Hooker) -> list[torch.Tensor]:
    """Rank r has STEPS + r batches; ranks that run out shadow the others' collectives (torch's Join)."""
    torch.manual_seed(0)
    model = h.ddp(mlp(WIDTH, 4))
    opt = sgd(model)
    with Join([model]):
        fit(model, opt, batches(STEPS + dist.get_rank()))
    return state_of(model)  # after Join's exit, which syncs the final model from the last rank to join


def static_graph(h: Hooker) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = h.ddp(mlp(WIDTH, 4), static_graph=True)
    opt = sgd(model, momentum=0.9)
    return fit(model, opt, batches(STEPS))


class Branchy(nn.Module):
    """A trunk and two heads; which head a step uses depends on the rank and the step."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.left, self.right = mlp(WIDTH, WIDTH), mlp(WIDTH, 2), mlp(WIDTH, 2)

    def forward(self, x: torch.Tensor, go_left: bool) -> torch.Tensor:
        return (self.left if go_left else self.right)(self.trunk(x))


def control_flow_differs_per_rank(h: Hooker) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = h.ddp(Branchy(), find_unused_parameters=True)
    opt = sgd(model)
    for step, x in enumerate(batches(STEPS)):
        opt.zero_grad()
        model(x, go_left=(dist.get_rank() + step) % 2 == 0).square().mean().backward()
        opt.step()
    return state_of(model)


class TiedLM(nn.Module):
    """Input and output embeddings share one weight, and one block is applied twice."""

    def __init__(self, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH)
        self.block = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.block(torch.tanh(self.block(self.embed(tokens))))))


def shared_parameters(h: Hooker) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = h.ddp(TiedLM())
    opt = sgd(model)
    gen = torch.Generator().manual_seed(1000 * dist.get_rank())
    for _ in range(STEPS):
        tokens = torch.randint(0, 50, (8, 6), generator=gen)
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    return state_of(model)


def frozen_parameters(h: Hooker) -> list[torch.Tensor]:
    """The first layer and one bias take no gradient (fine-tuning's shape)."""
    torch.manual_seed(0)
    module = mlp(WIDTH, 4, depth=4)
    module[0].requires_grad_(False)
    module[2].bias.requires_grad_(False)
    model = h.ddp(module)
    opt = sgd(model)
    return fit(model, opt, batches(STEPS))


def no_sync_accumulation(h: Hooker) -> list[torch.Tensor]:
    """Two micro-batches accumulate locally under no_sync; the third backward reduces all three."""
    torch.manual_seed(0)
    model = h.ddp(mlp(WIDTH, 4))
    opt = sgd(model)
    data = batches(3 * STEPS)
    for _ in range(STEPS):
        opt.zero_grad()
        with model.no_sync():
            for _ in range(2):
                model(next(data)).square().mean().backward()
        model(next(data)).square().mean().backward()
        opt.step()
    return state_of(model)


def gradient_as_bucket_view(h: Hooker) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = h.ddp(mlp(WIDTH, 4), gradient_as_bucket_view=True)
    opt = sgd(model, momentum=0.9)
    return fit(model, opt, batches(STEPS))


def batchnorm_buffers(h: Hooker) -> list[torch.Tensor]:
    """BatchNorm's running statistics broadcast from rank 0 every forward; an eval forward every other step."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))
    # broadcast_buffers=True, under the name torch 2.13 gives it (the old one warns).
    model = h.ddp(module, **{BUFFER_SYNC: True})
    opt = sgd(model)
    for step, x in enumerate(batches(STEPS)):
        model.train()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if step % 2 == 0:
            model.eval()
            with torch.no_grad():
                model(x + 1.0)
    return state_of(model)


def tiny_buckets(h: Hooker) -> list[torch.Tensor]:
    """About one bucket per weight (11 here), rebuilt after the first backward."""
    torch.manual_seed(0)
    model = h.ddp(mlp(WIDTH, 4, depth=12), bucket_cap_mb=0.001)
    opt = sgd(model)
    return fit(model, opt, batches(STEPS))


def bucket_larger_than_a_piece(h: Hooker) -> list[torch.Tensor]:
    """One 25 KB bucket through 1 KB pipeline pieces (the Hooker is built with chunk_bytes=1024)."""
    torch.manual_seed(0)
    model = h.ddp(mlp(WIDTH, 4, depth=12), bucket_cap_mb=1)
    opt = sgd(model)
    return fit(model, opt, batches(STEPS))


class _NormalisedAcrossRanks(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the all-rank mean of its squared norm, averaged
    with a direct ``all_reduce_mean_`` call while the hook still has earlier buckets in flight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hooker: Hooker) -> torch.Tensor:
        ctx.hooker = hooker
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        norm = ctx.hooker.mean_(grad.square().sum().reshape(1))
        return grad / (1.0 + norm.sqrt()), None


class Normalised(nn.Module):
    def __init__(self, hooker: Hooker) -> None:
        super().__init__()
        self.hooker = hooker
        self.low, self.high = mlp(WIDTH, WIDTH, depth=4), mlp(WIDTH, 4, depth=6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.high(_NormalisedAcrossRanks.apply(self.low(x), self.hooker))


def direct_calls_during_backward(h: Hooker) -> list[torch.Tensor]:
    """The program calls the communicator itself inside backward (a gradient statistic across ranks), on
    the same groups and at the same time as the hook's buckets."""
    torch.manual_seed(0)
    model = h.ddp(Normalised(h))
    opt = sgd(model, lr=0.5)
    return fit(model, opt, batches(STEPS))


PATTERNS: dict[str, Callable[[Hooker], list[torch.Tensor]]] = {
    f.__name__: f for f in (
        several_models_in_one_backward, direct_calls_during_backward, uneven_inputs_under_join, static_graph, control_flow_differs_per_rank,
        shared_parameters, frozen_parameters, no_sync_accumulation, gradient_as_bucket_view, batchnorm_buffers,
        tiny_buckets, bucket_larger_than_a_piece,
    )
}
CHUNK_BYTES = {"bucket_larger_than_a_piece": 1024}


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _same_everywhere(value: str) -> bool:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return all(v == gathered[0] for v in gathered)


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
    try:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    except (AssertionError, ValueError) as exc:
        return str(exc).strip().splitlines()[0][:300]
    return "yes"


def run_pattern(name: str, groups: CommGroups, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    """Every variant of one pattern: whether it matches plain DDP and has identical bits on every rank.
    (The broken variant's mismatch shows the run depends on what the hook returns.)"""
    pattern = PATTERNS[name]
    finals: dict[str, list[torch.Tensor]] = {}
    buckets: dict[str, int] = {}
    for variant in variants:
        hooker = Hooker(variant, groups, CHUNK_BYTES.get(name))
        try:
            finals[variant] = pattern(hooker)
            buckets[variant] = hooker.buckets()
        finally:
            hooker.close()
    out: dict[str, Any] = {}
    reference = finals["ddp"]
    for variant, final in finals.items():
        out[variant] = {"identical_across_ranks": _same_everywhere(_digest(final)),
                        "matches_ddp": _compare(final, reference), "buckets": buckets[variant]}
    return out


def refusals(groups: CommGroups) -> dict[str, str]:
    """What register_comm_hook says to program shapes it cannot serve (each one line, before any step)."""
    out: dict[str, str] = {}
    comm = make_communicator("flat", groups)

    def refused(name: str, model: DDP, communicator: Communicator) -> None:
        try:
            register_comm_hook(model, communicator)
            out[name] = "accepted"
        except ValueError as exc:
            out[name] = str(exc)

    pair = dist.new_group([0, 1])  # every rank creates it; only ranks 0 and 1 are members
    if dist.get_rank() in (0, 1):
        refused("subgroup", DDP(mlp(WIDTH, 2), process_group=pair), comm)
    dist.barrier()
    refused("complex", DDP(nn.Linear(4, 4).to(torch.complex64)), comm)
    nccl = make_communicator("flat", dataclasses.replace(groups, intra_backend="nccl", inter_backend="nccl"))
    refused("nccl_on_cpu", DDP(mlp(WIDTH, 2)), nccl)
    dist.destroy_process_group(pair)
    return out


def run_patterns(names: list[str], rounds: int = 1) -> dict[str, Any]:
    """Entry point of the test job: one set of groups, every named pattern ``rounds`` times."""
    env = init_distributed(timeout_s=60)
    try:
        topo = discover_topology(env)
        torch.set_num_threads(1)
        groups = CommGroups.build(topo, timeout_s=60)
        results: dict[str, Any] = {"rank": env.rank}
        for name in names:
            if name == "refusals":
                results[name] = refusals(groups)
            else:
                results[name] = [run_pattern(name, groups) for _ in range(rounds)]
        with contextlib.suppress(Exception):
            groups.destroy()
        return results
    finally:
        shutdown_distributed()
