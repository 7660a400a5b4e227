"""Rank code for the node-sharded optimizer's cases in tests/test_comm_multiprocess.py: the optimizer built by
hand over a DDP model, as a user's program does, against torch DDP with the optimizer it wraps."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hybrid.core.comm import CommGroups, make_communicator
from hybrid.core.node_sharded_optimizer import NodeShardedOptimizer, optimizer_state_bytes
from hybrid.core.topology import Topology

__all__ = ["case_zero"]

WIDTH, STEPS, NAN_STEP, CLIP = 32, 8, 5, 0.2


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as transformer recipes have it: two param groups."""
    matrices = [p for p in model.parameters() if p.dim() > 1]
    others = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": matrices}, {"params": others, "weight_decay": 0.0}]


def _run(comm_name: str | None, groups: CommGroups, base: nn.Module, factory: Any, clip: float | None,
         nan_rank: int | None) -> dict[str, Any]:
    """STEPS steps on rank-specific batches; ``comm_name`` None: torch DDP with the optimizer itself, else the
    node-sharded optimizer over hybrid's hook. ``nan_rank``'s input holds a NaN at step NAN_STEP: that step's
    averaged gradients are non-finite on every rank, and the step is skipped."""
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.004, gradient_as_bucket_view=True)
    hook = None
    if comm_name is None:
        opt = factory(_groups(model.module))
    else:
        opt = NodeShardedOptimizer(_groups(model.module), factory)
        hook = opt.attach(model, make_communicator(comm_name, groups, chunk_bytes=1024))
    gen = torch.Generator().manual_seed(7 + 1000 * dist.get_rank())
    norms, skipped = [], []
    for step in range(STEPS):
        x, y = torch.randn(16, WIDTH, generator=gen), torch.randint(0, 4, (16,), generator=gen)
        if step == NAN_STEP and dist.get_rank() == nan_rank:
            x[0, 0] = float("nan")
        nn.functional.cross_entropy(model(x), y).backward()
        finite = opt.grads_finite() if comm_name else all(
            bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
        if not finite:
            skipped.append(step)
        else:
            if clip is not None:
                norm = opt.clip_grad_norm_(clip) if comm_name else nn.utils.clip_grad_norm_(model.parameters(), clip)
                norms.append(float(norm))
            opt.step()
        opt.zero_grad(set_to_none=False)
    state = opt.state_dict()
    if hook is not None:
        hook.close()
    return {"params": [p.detach().clone() for p in model.module.parameters()], "state": state, "norms": norms,
            "skipped": skipped, "state_bytes": optimizer_state_bytes(opt),
            "relayouts": getattr(opt, "relayouts", None)}


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    try:
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    except AssertionError as exc:
        return str(exc)[:300]
    return "yes"


def _states_close(got: dict[str, Any], ref: dict[str, Any]) -> str:
    if got["param_groups"] != ref["param_groups"]:
        return f"param_groups {got['param_groups']} != {ref['param_groups']}"
    if got["state"].keys() != ref["state"].keys():
        return f"state keys {sorted(got['state'])} != {sorted(ref['state'])}"
    for i, entry in ref["state"].items():
        if entry.keys() != got["state"][i].keys():
            return f"param {i}: {sorted(got['state'][i])} != {sorted(entry)}"
        for k, v in entry.items():
            if v.shape != got["state"][i][k].shape:
                return f"param {i} {k}: shape {tuple(got['state'][i][k].shape)} != {tuple(v.shape)}"
        verdict = _close([got["state"][i][k] for k in entry], list(entry.values()))
        if verdict != "yes":
            return f"param {i}: {verdict}"
    return "yes"


def case_zero(topo: Topology, groups: CommGroups, params: dict) -> dict[str, Any]:
    """AdamW with two param groups and clipping (biting on some steps), and SGD with momentum, node-sharded (over sharded's
    and hierarchical's hooks) against torch DDP; a NaN in one rank's batch skips one step everywhere."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))
    adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    last = topo.world_size - 1
    out: dict[str, Any] = {}
    ddp = _run(None, groups, base, adamw, CLIP, last)
    for name in params.get("comms", ("sharded", "hierarchical")):
        run = _run(name, groups, base, adamw, CLIP, last)
        out[f"adamw-{name}"] = {
            "matches_ddp": _close(run["params"], ddp["params"]),
            "state_matches_ddp": _states_close(run["state"], ddp["state"]) if topo.rank == 0 else "yes",
            "norms_match": _close([torch.tensor(run["norms"])], [torch.tensor(ddp["norms"])]),
            "clipped": sum(n > CLIP for n in ddp["norms"]), "skipped": run["skipped"], "ddp_skipped": ddp["skipped"],
            "state_bytes": run["state_bytes"], "ddp_state_bytes": ddp["state_bytes"], "relayouts": run["relayouts"],
            "params": hash(tuple(float(p.sum()) for p in run["params"]))}
    if not params.get("sgd", True):
        return out
    ddp_sgd = _run(None, groups, base, sgd, None, None)
    zero_sgd = _run("sharded", groups, base, sgd, None, None)
    out["sgd"] = {"matches_ddp": _close(zero_sgd["params"], ddp_sgd["params"]),
                  "state_matches_ddp": _states_close(zero_sgd["state"], ddp_sgd["state"]) if topo.rank == 0 else "yes",
                  "moved": max((p - q).abs().max().item() for p, q in zip(zero_sgd["params"], base.parameters()))}
    return out
