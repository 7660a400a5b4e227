"""One worker of a torchft replica group: the torchft side of ``python -m hybrid.bench ft`` (:mod:`hybrid.tools.bench_ft`).

Written the way torchft's own examples are (``train_ddp.py``, ``train_fsdp.py``, ``examples/diloco``): a
``Manager`` over a ``ProcessGroupGloo`` reaching the lighthouse named by ``TORCHFT_LIGHTHOUSE``, one replica group
per node (``REPLICA_GROUP_ID`` of ``NUM_REPLICA_GROUPS``), each group a ``torchrun`` of its own, a state dict
for healing from a live peer. What it trains is what hybrid's trainer trains from the same Hydra overrides,
built by hybrid's own components: the model and its initial weights (``trainer.seed``), the data in the same
global order (:class:`~hybrid.app.components.data.BatchStream`, rank = group x workers + local rank), AdamW and
its schedule, the loss and the clipping. So the two systems differ only in how they keep the replicas equal and
recover them.

Modes (``--mode``):

- ``ddp``: one worker per group, torchft's ``DistributedDataParallel`` and ``Optimizer`` (train_ddp.py);
- ``hsdp``: several workers per group, FSDP2 over the group's workers and the Manager across groups (its
  all-reduce hook on every FSDP module), DCP's state dicts for healing (train_fsdp.py, torchtitan's torchft
  HSDP);
- ``diloco``: ``torchft.local_sgd.DiLoCo`` with ``--fragments`` model fragments (Streaming DiLoCo), inner AdamW,
  the outer optimizer of ``comm.outer_optim`` (examples/diloco);
- ``plain``: torch's own DDP (or FSDP2 with ``--workers-per-group`` > 1... as hsdp but without torchft) over
  one torchrun rendezvous of every node: the fault tolerance off, the cost of it shown by the difference.

Output: the first worker of each group prints ``ft step N loss L`` after each committed step (a step torchft
did not commit prints nothing), and ``ft healed B bytes from replica R`` after a recovery from a peer; every
worker writes ``--out/g<group>-r<rank>.json`` at the end (steps, checksum of what it holds, tail loss).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import statistics
import sys
import time
from collections import deque
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["main"]

MODES = ("ddp", "hsdp", "diloco", "plain")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid.tools.ft_worker", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--out", required=True, help="folder for each worker's result file")
    p.add_argument("--fragments", type=int, default=1, help="diloco: model fragments (Streaming DiLoCo)")
    p.add_argument("--fragment-sync-delay", type=int, default=0, help="diloco: inner steps an exchange may take")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of hybrid's training config (model, data, optim)")
    return p


def _tensor_bytes(state: Any) -> int:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local().numel() * state.element_size()
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


def _checksum(tensors: list[Any]) -> str:
    """sha256 of what this worker holds: its local shards where the tensors are DTensors."""
    from torch.distributed.tensor import DTensor

    digest = hashlib.sha256()
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        digest.update(local.detach().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _fragments(model: Any, count: int) -> list[Any]:
    """``count`` contiguous runs of the model's top-level children, of about equal parameter counts."""
    import torch.nn as nn

    children = [c for c in model.children() if any(True for _ in c.parameters())]
    if count < 1 or count > len(children):
        raise SystemExit(f"--fragments {count}: the model has {len(children)} top-level parts with parameters")
    sizes = [sum(p.numel() for p in c.parameters()) for c in children]
    target, fragments, current, held = sum(sizes) / count, [], [], 0.0
    for child, size in zip(children, sizes):
        current.append(child)
        held += size
        left = len(children) - children.index(child) - 1
        if len(fragments) < count - 1 and (held >= target * (len(fragments) + 1) or left == count - 1 - len(fragments)):
            fragments.append(nn.ModuleList(current))
            current = []
    fragments.append(nn.ModuleList(current))
    return fragments


class Stream:
    """hybrid's batch stream of this worker, put at committed step ``step``'s samples when it is not there (after
    torchft healed this group from a peer at a later step: what a user's StatefulDataLoader restore does)."""

    def __init__(self, dataset: Any, batch: int, rank: int, world: int, seed: int) -> None:
        from hybrid.app.components.data import BatchStream

        self.stream = BatchStream(dataset, batch, rank, world, seed, pin_memory=False, num_workers=0)
        self.global_batch, self.at = batch * world, 0
        self.per_epoch = len(dataset) // self.global_batch * self.global_batch

    def next(self, step: int) -> tuple[Any, Any]:
        if step != self.at:
            samples = step * self.global_batch
            self.stream.restore({"epoch": samples // self.per_epoch, "samples": samples % self.per_epoch})
        self.at = step + 1
        return next(self.stream)


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    from hybrid.app.checks import compose_train_config
    from hybrid.app.setup import build_loss, load_dataset

    groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    per_group = int(os.environ["LOCAL_WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    cfg = compose_train_config([*args.overrides, f"cluster.nnodes={groups}", f"cluster.nproc_per_node={per_group}"])
    dataset = load_dataset(cfg.data)
    stream = Stream(dataset, cfg.data.batch_size, group * per_group + local, groups * per_group, cfg.trainer.seed)
    return {"cfg": cfg, "group": group, "groups": groups, "local": local, "per_group": per_group,
            "stream": stream, "loss_fn": build_loss(cfg.loss)}


def _model(cfg: Any) -> Any:
    import torch

    from hybrid.app.setup import build_model

    torch.manual_seed(cfg.trainer.seed)  # the same initial weights as hybrid's trainer (build_training)
    return build_model(cfg.model, torch.device("cpu"))


def _optimizer(params: Any, cfg: Any) -> Any:
    from hybrid.app.components.optim import build_optimizer

    return build_optimizer(params, cfg.optim)


def _set_lr(optimizer: Any, base: list[float], step: int, cfg: Any) -> None:
    from hybrid.app.components.optim import lr_factor

    factor = lr_factor(step, cfg.optim, cfg.trainer.max_steps)
    for group, lr in zip(optimizer.param_groups, base):
        group["lr"] = lr * factor


def _manager(pg: Any, group: int, state: tuple[Any, Any], transport: Any | None, **kwargs: Any) -> Any:
    from torchft import Manager

    load, save = state
    return Manager(pg=pg, min_replica_size=1, load_state_dict=load, state_dict=save,
                   replica_id=f"hybrid_bench_ft_{group}", timeout=timedelta(seconds=30),
                   checkpoint_transport=transport, **kwargs)


def _healed(received: dict[str, Any], what: Any, manager_of: Any) -> None:
    received["bytes"] += _tensor_bytes(what)
    received["times"] += 1
    received["step"] = manager_of().current_step() if manager_of() is not None else None


class Built:
    """What one mode builds: the model as it trains, the optimizer stepped, the inner optimizer (whose learning rate
    the schedule sets), torchft's Manager and DiLoCo (None where the mode has none), and what healing received."""

    def __init__(self, model: Any, optimizer: Any, inner: Any, manager: Any = None, diloco: Any = None,
                 received: dict[str, Any] | None = None) -> None:
        self.model, self.optimizer, self.inner, self.manager, self.diloco = model, optimizer, inner, manager, diloco
        self.received = received if received is not None else {"bytes": 0, "times": 0, "step": None}


def _plain(model: Any, s: dict[str, Any]) -> Built:
    """torch alone over one rendezvous of every node: DDP, or FSDP2 on a (groups, workers) mesh."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if s["per_group"] > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from hybrid.app.replicas.hsdp import shard_model

        mesh = init_device_mesh("cpu", (s["groups"], s["per_group"]), mesh_dim_names=("replicate", "shard"))
        model = shard_model(model, mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = _optimizer(model.parameters(), s["cfg"])
    return Built(model, optimizer, optimizer)


def _pg_transport(pg: Any) -> Any:
    import torch
    from torchft.checkpointing.pg_transport import PGTransport

    return PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))


def _whole_state(built: Built, model: Any, inner: Any, optim_key: str) -> tuple[Any, Any]:
    """The Manager's (load, save) of an unsharded model and its optimizer, under the keys torchft's examples use
    (``optim`` for DDP, ``inner_optim`` for DiLoCo); a load counts what healing received."""

    def load(state: dict[str, Any]) -> None:
        _healed(built.received, state, lambda: built.manager)
        model.load_state_dict(state["model"])
        inner.load_state_dict(state[optim_key])

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), optim_key: inner.state_dict()}

    return load, save


def _ddp(model: Any, s: dict[str, Any], pg: Any) -> Built:
    """torchft's DDP, Manager and Optimizer (its train_ddp.py), healing over the process group."""
    from torchft import Optimizer

    inner = _optimizer(model.parameters(), s["cfg"])
    built = Built(model, None, inner)
    built.manager = _manager(pg, s["group"], _whole_state(built, model, inner, "optim"), _pg_transport(pg))
    built.model = _fixed_ddp()(built.manager, model)
    built.optimizer = Optimizer(built.manager, inner)
    return built


def _hsdp(model: Any, s: dict[str, Any], pg: Any) -> Built:
    """FSDP2 over the group's workers, the Manager's all-reduce across groups on every FSDP module's gradients,
    DCP's state dicts for healing (train_fsdp.py, torchtitan's torchft HSDP)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchft import Optimizer

    from hybrid.app.replicas.hsdp import shard_model

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the group's own workers
    model = shard_model(model, init_device_mesh("cpu", (s["per_group"],), mesh_dim_names=("shard",)))
    inner = _optimizer(model.parameters(), s["cfg"])
    built = Built(model, None, inner)

    def load(state: dict[str, Any]) -> None:
        _healed(built.received, state, lambda: built.manager)
        set_state_dict(model, inner, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def save() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, inner)
        return {"model": model_state, "optim": optim_state}

    manager = built.manager = _manager(pg, s["group"], (load, save), None, use_async_quorum=False)

    def across_groups(output: torch.Tensor) -> None:
        manager.allreduce(output).wait()  # averaged over the participating groups

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(across_groups)
    built.optimizer = Optimizer(manager, inner)
    return built


def _diloco(model: Any, s: dict[str, Any], pg: Any, args: argparse.Namespace) -> Built:
    """``torchft.local_sgd.DiLoCo`` over ``--fragments`` fragments (examples/diloco), the outer optimizer of
    ``comm.outer_optim``."""
    import torch
    from torchft.local_sgd import DiLoCo

    from hybrid.app.config import outer_optimizer

    cfg = s["cfg"]
    inner = _optimizer(model.parameters(), cfg)
    build_outer = outer_optimizer(cfg.comm).build()  # whatever class comm.outer_optim names, as hybrid builds it
    fragments = _fragments(model, args.fragments)
    outers = [build_outer(list(f.parameters())) for f in fragments]
    built = Built(model, inner, inner)
    built.manager = _manager(pg, s["group"], _whole_state(built, model, inner, "inner_optim"), _pg_transport(pg),
                             use_async_quorum=False)
    built.diloco = DiLoCo(built.manager, fragments, inner, outers, sync_every=cfg.comm.sync_every,
                          backup_device=torch.device("cpu"), pin_memory=False,
                          fragment_sync_delay=args.fragment_sync_delay)
    return built


def run(args: argparse.Namespace) -> dict[str, Any]:
    s = _setup(args)
    model = _model(s["cfg"])
    if args.mode == "plain":
        built = _plain(model, s)
    else:
        from torchft import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timedelta(seconds=5))  # the examples' CPU choice
        builders = {"ddp": _ddp, "hsdp": _hsdp, "diloco": lambda m, s_, p: _diloco(m, s_, p, args)}
        built = builders[args.mode](model, s, pg)
    return _train(s, built)


def _fixed_ddp() -> type:
    """torchft's ``DistributedDataParallel`` with its comm hook fixed for a peer's loss. Shipped (0.2.0), the hook
    hands DDP's reducer the process group's own future: after a peer's loss that is the no-op work's future, on
    which the hook asserts (meta-pytorch/torchft#294, open), or a failed gloo future, on which torch 2.13's
    reducer crashes (SIGSEGV, seen here). Either way the survivors die instead of going on. Fixed, the hook waits
    for the Manager's work (which averages the bucket in place, or records the error so that ``should_commit``
    discards the step) and hands the reducer a future finished with the bucket itself."""
    import torch
    from torchft import DistributedDataParallel

    class Fixed(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # noqa: ANN001, ANN205 - DDP checks a hook's annotations: a string fails
            state.allreduce(bucket.buffer()).wait()
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return Fixed


def _step_of(manager: Any, done: int) -> int:
    return manager.current_step() if manager is not None else done


def _train(s: dict[str, Any], built: Built) -> dict[str, Any]:
    import torch

    from hybrid.app.components.losses import batch_loss

    model, optimizer, inner, manager, diloco, received = (built.model, built.optimizer, built.inner, built.manager,
                                                          built.diloco, built.received)
    base = [g["lr"] for g in inner.param_groups]
    cfg, stream, loss_fn = s["cfg"], s["stream"], s["loss_fn"]
    first = s["local"] == 0
    from hybrid.app.observability.metrics import TAIL_STEPS  # metrics.json's tail_loss: the same steps

    losses: deque[float] = deque(maxlen=TAIL_STEPS)
    attempts = committed = 0
    step_times: list[float] = []
    local_steps = 0  # diloco: inner steps (its manager's step counts outer syncs)
    context = diloco if diloco is not None else contextlib.nullcontext()
    last = time.monotonic()
    with context:
        while True:
            step = local_steps if diloco is not None else _step_of(manager, committed)
            if step >= cfg.trainer.max_steps:
                break
            _set_lr(inner, base, step, cfg)
            x, y = stream.next(step)
            optimizer.zero_grad()
            loss = batch_loss(model, x, y, loss_fn)
            loss.backward()
            if cfg.trainer.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip_norm)
            optimizer.step()
            attempts += 1
            after = local_steps + 1 if diloco is not None else _step_of(manager, committed + 1)
            if diloco is not None:
                local_steps += 1
            if after > step:  # committed (torchft DDP/HSDP: should_commit said so; plain: always)
                committed += 1
                losses.append(float(loss))
                now = time.monotonic()
                step_times.append(now - last)
                last = now
                if first:
                    print(f"ft step {after} loss {float(loss):.4f}", flush=True)
            if received["times"] and first and received.get("said") != received["times"]:
                received["said"] = received["times"]
                print(f"ft healed {received['bytes']} bytes at step {received['step']}", flush=True)
    reached = local_steps if diloco is not None else _step_of(manager, committed)
    return _result(s, built, {"steps": reached, "committed": committed, "attempts": attempts,
                              "tail_loss": statistics.fmean(losses) if losses else None, "step_times": step_times})


def _result(s: dict[str, Any], built: Built, counts: dict[str, Any]) -> dict[str, Any]:
    """This worker's result file: ``steps`` is the step it ended at (a group healed past a step it did not commit
    itself counts it), ``committed`` the steps it committed, the checksum of what it holds."""
    held = list(built.model.parameters())
    if built.diloco is not None:  # the global copy: streaming leaves each fragment's local weights apart until sync
        held = [t for f in built.diloco._fragments for t in f.original_parameters.values()]
    return {"group": s["group"], "local_rank": s["local"], **counts, "checksum": _checksum(held),
            "received_bytes": built.received["bytes"], "healed": built.received["times"]}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"g{result['group']}-r{result['local_rank']}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)  # torchft's manager threads must not hold the exit (the result is written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
