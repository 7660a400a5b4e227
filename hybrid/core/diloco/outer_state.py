"""Who holds DiLoCo's outer state, and how a rank's share of it is saved and taken back in any layout.

The outer loop's state (the fp32 global weights and the outer optimizer's state, e.g. Nesterov momentum) is
the same on every node: each node applies the same outer step to the same mean. With ``inter=sharded`` a
node's workers split it by whole tensors (:func:`owners`), so each holds about 1/g of it, as ZeRO-1 splits
an optimizer's state (Rajbhandari et al., arXiv 1910.02054); with ``inter=hierarchical`` every worker holds
all of it. Whole tensors keep any ``torch.optim`` outer optimizer's per-tensor meaning (Adafactor's factored
moments, a norm-based step).

A rank's *share* (its weights, and :func:`optimizer_share`) names its tensors by their index in the model's parameters, so shares
saved from one layout load into another (:func:`merge_shares`, :func:`load_optimizer_share`): each rank takes
the tensors it owns now from whichever shares hold them.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["merge_shares", "load_optimizer_share", "optimizer_share", "owners"]


def owners(fragments: list[list[int]], nbytes: list[int], workers: int) -> list[int]:
    """The local rank that holds each tensor's outer state: within each fragment (whose exchange then spreads
    over the node's workers), the largest tensors first, each to the worker holding the least so far (ties: the
    lower local rank). Deterministic: every rank computes the same owners."""
    owner = [0] * len(nbytes)
    load = [0] * workers
    for run in fragments:
        for i in sorted(run, key=lambda t: (-nbytes[t], t)):
            j = min(range(workers), key=lambda w: (load[w], w))
            owner[i] = j
            load[j] += nbytes[i]
    return owner


def optimizer_share(optimizer: torch.optim.Optimizer | None, index_of: dict[int, int]) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with ``positions``: the tensor index (``index_of[id(param)]``) of each of torch's
    positions, which number the parameters group by group."""
    if optimizer is None:
        return None
    state = optimizer.state_dict()
    positions = [index_of[id(p)] for group in optimizer.param_groups for p in group["params"]]
    return {**state, "positions": positions}


def merge_shares(shares: list[dict[str, Any]]) -> dict[str, Any]:
    """Every saved share as one: ``global`` {tensor index: fp32 weights}, ``state`` {tensor index: optimizer
    state}, ``groups`` (the first share's param groups, without their parameters) and ``deltas`` (per exchange
    in flight, {tensor index: its mean pseudo-gradient})."""
    merged: dict[str, Any] = {"global": {}, "state": {}, "groups": None, "deltas": []}
    for share in shares:
        merged["global"].update(share["global"])
        optimizer = share.get("outer")
        if optimizer is not None:
            for position, state in optimizer["state"].items():
                merged["state"][optimizer["positions"][int(position)]] = state
            if merged["groups"] is None:
                merged["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
        for k, deltas in enumerate(share.get("deltas", [])):
            if len(merged["deltas"]) <= k:
                merged["deltas"].append({})
            merged["deltas"][k].update(deltas)
    return merged


def load_optimizer_share(optimizer: torch.optim.Optimizer | None, index_of: dict[int, int],
                         merged: dict[str, Any]) -> None:
    """Load into ``optimizer`` (over this rank's tensors) the state that ``merged`` holds for them, with the saved
    groups' settings (lr, momentum...). One line where the groups do not line up."""
    if optimizer is None or merged["groups"] is None:
        return
    if len(merged["groups"]) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's outer optimizer has {len(merged['groups'])} param group(s), this "
                         f"rank's {len(optimizer.param_groups)}: build the outer optimizer with one group")
    state, groups, position = {}, [], 0
    for saved, group in zip(merged["groups"], optimizer.param_groups, strict=True):
        mine = []
        for p in group["params"]:
            if index_of[id(p)] in merged["state"]:
                state[position] = merged["state"][index_of[id(p)]]
            mine.append(position)
            position += 1
        groups.append({**saved, "params": mine})
    optimizer.load_state_dict({"state": state, "param_groups": groups})
