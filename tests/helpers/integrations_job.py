"""One torchrun job (2 agents x 2 workers) that trains with Lightning, the Hugging Face Trainer and an accelerate
loop, each plain and with hybrid, and tries hybrid.attach's refusals and node discovery; tests/test_integrations.py
reads what every rank saved.

Run as users run theirs: ``torchrun --nnodes 2 --nproc-per-node 2 --node-rank N ... integrations_job.py OUT``.
Every case runs in these same processes (the libraries' imports cost seconds per process), one after the
other, from the same seed; a case that raises is recorded with its error and the next one runs.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import hybrid
from hybrid.core.attach import Attached

OUT = Path(sys.argv[1] if __name__ == "__main__" else ".")
STEPS = 4  # optimizer steps
ACCUMULATE = 2  # micro-batches per optimizer step
TEXT = "".join(p.read_text() for p in sorted((Path(__file__).resolve().parents[2] / "docs").glob("*.md")))


def flat_weights(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def hook_record(attached) -> dict:
    """What one attached communicator did: phase calls per rank, buckets handed over, steps (last buckets)."""
    traces = list(attached.hooks[0].traces) if attached.hooks else []
    return {"calls": {k: v.calls for k, v in attached.counters.snapshot().items()},
            "buckets": len(traces), "steps": sum(t.last for t in traces),
            "buckets_per_step": attached.hooks[0].buckets_per_step if attached.hooks else 0,
            "algorithm": attached.communicator.name, "nodes": attached.topology.nodes,
            "source": attached.node_source}


def sabotage(attached) -> None:
    """Scale every average by 1.001: the parity checks must see it."""
    comm = attached.communicator
    average = comm.all_reduce_mean_
    comm.all_reduce_mean_ = lambda tensor, key=None: average(tensor, key).mul_(1.001)


# ---- Lightning -------------------------------------------------------------------------------------------------

def lightning_cases() -> dict:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from hybrid.integrations.lightning import HybridCommCallback

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))

        def training_step(self, batch, index):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    class Sabotaged(HybridCommCallback):
        def on_fit_start(self, trainer, pl_module) -> None:
            super().on_fit_start(trainer, pl_module)
            sabotage(self.attached)

    data = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=data)
    dataset = torch.utils.data.TensorDataset(x, x[:, :8].sum(1, keepdim=True).tanh())

    def fit(callback=None, **strategy):
        torch.manual_seed(0)
        model = Regressor()
        trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_steps=STEPS,
                             strategy=DDPStrategy(bucket_cap_mb=0.25, **strategy),
                             accumulate_grad_batches=ACCUMULATE, callbacks=[callback] if callback else [],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(model, torch.utils.data.DataLoader(dataset, batch_size=8))
        record = {"weights": flat_weights(model)}
        if callback is not None:
            record.update(hook_record(callback.attached))
        return record

    hook_and_hybrid = HybridCommCallback()
    return {
        "lightning/plain": lambda: fit(),
        "lightning/hierarchical": lambda: fit(HybridCommCallback("hierarchical")),
        "lightning/sharded": lambda: fit(HybridCommCallback("sharded")),
        "lightning/sabotaged": lambda: fit(Sabotaged("hierarchical")),
        "lightning/strategy-hook-too": lambda: fit(hook_and_hybrid, ddp_comm_hook=default_hooks.allreduce_hook),
    }


# ---- Hugging Face Trainer ----------------------------------------------------------------------------------------

def gpt2_on_text():
    """gpt2's architecture, randomly initialised (nothing downloaded), on this repository's docs, one byte a token."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.tensor(list(TEXT.encode()[: 64 * 128]), dtype=torch.long).view(128, 64)
    return model, [{"input_ids": row, "labels": row} for row in ids]


def trainer_cases() -> dict:
    from transformers import Trainer, TrainingArguments

    from hybrid.integrations.transformers import HybridCommCallback

    class Sabotaged(HybridCommCallback):
        def on_train_begin(self, args, state, control, **kwargs) -> None:
            super().on_train_begin(args, state, control, **kwargs)
            sabotage(self.attached)

    def train(callback=None):
        model, dataset = gpt2_on_text()
        args = TrainingArguments(output_dir=str(OUT / "hf"), use_cpu=True, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=ACCUMULATE, max_steps=STEPS, learning_rate=0.05,
                                 optim="sgd", lr_scheduler_type="constant", report_to="none", save_strategy="no",
                                 logging_strategy="no", disable_tqdm=True, seed=0, ddp_bucket_cap_mb=1,
                                 max_grad_norm=0.0)  # clipping to norm 1 would divide the sabotage's 1.001 out
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback] if callback else [])
        trainer.train()
        record = {"weights": flat_weights(model)}
        if callback is not None:
            record.update(hook_record(callback.attached))
        return record

    return {
        "trainer/plain": lambda: train(),
        "trainer/hierarchical": lambda: train(HybridCommCallback("hierarchical")),
        "trainer/sabotaged": lambda: train(Sabotaged("hierarchical")),
    }


# ---- accelerate --------------------------------------------------------------------------------------------------

def accelerate_cases() -> dict:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    def loop(algorithm=None, sabotaged=False):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE,
                                  kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1)])
        model, dataset = gpt2_on_text()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = torch.utils.data.DataLoader(dataset, batch_size=4)
        ddp, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        attached = hybrid.attach(ddp, algorithm) if algorithm else None
        if sabotaged:
            sabotage(attached)
        for index, batch in enumerate(loader):
            if index == STEPS * ACCUMULATE:
                break
            with accelerator.accumulate(ddp):
                accelerator.backward(ddp(**batch).loss)
                optimizer.step()
                optimizer.zero_grad()
        record = {"weights": flat_weights(model)}
        if attached is not None:
            attached.close()
            record.update(hook_record(attached))
        return record

    return {
        "accelerate/plain": lambda: loop(),
        "accelerate/hierarchical": lambda: loop("hierarchical"),
        "accelerate/sharded": lambda: loop("sharded"),
        "accelerate/sabotaged": lambda: loop("hierarchical", sabotaged=True),
    }


# ---- hybrid.attach: where the nodes come from, and what it refuses -----------------------------------------------

NODE_VARIABLES = ("GROUP_RANK", "SLURM_NODEID", "NODE_RANK", "LOCAL_RANK", "SLURM_LOCALID")


@contextmanager
def environment(variables: dict, host: str | None = None):
    """Only ``variables`` of the launchers' node variables set, and ``host`` as the host name, inside."""
    saved = {name: os.environ.pop(name) for name in NODE_VARIABLES if name in os.environ}
    os.environ.update(variables)
    gethostname = socket.gethostname
    if host is not None:
        socket.gethostname = lambda: host
    try:
        yield
    finally:
        socket.gethostname = gethostname
        for name in variables:
            os.environ.pop(name, None)
        os.environ.update(saved)


def found_nodes(variables: dict, host: str | None = None) -> dict:
    with environment(variables, host), hybrid.connect("hierarchical", timeout_s=30) as attached:
        return {"nodes": attached.topology.nodes, "source": attached.node_source}


def attach_cases() -> dict:
    node, local = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    rank = dist.get_rank()

    def ddp(**kwargs):
        torch.manual_seed(0)
        return nn.parallel.DistributedDataParallel(nn.Linear(4, 4), **kwargs)

    def already_hooked():
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model = ddp()
        model.register_comm_hook(None, default_hooks.allreduce_hook)
        return hybrid.attach(model)

    def builtin_hooked():  # what accelerate's DistributedDataParallelKwargs(comm_hook=...) registers
        model = ddp()
        model._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
        return hybrid.attach(model)

    def over_a_node_group():
        group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
        return hybrid.attach(ddp(process_group=group))

    def two_models(algorithm=None):
        """A generator feeding a discriminator, both DDP, one backward through both: one communicator for both."""
        torch.manual_seed(0)
        first, second = nn.Linear(16, 16), nn.Linear(16, 1)
        models = [nn.parallel.DistributedDataParallel(m) for m in (first, second)]
        attached = hybrid.attach(models, algorithm) if algorithm else None
        optimizer = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1, momentum=0.9)
        batches = torch.Generator().manual_seed(rank)
        for _ in range(3):
            optimizer.zero_grad()
            models[1](models[0](torch.randn(8, 16, generator=batches))).pow(2).mean().backward()
            optimizer.step()
        if attached is not None:
            attached.close()
        return {"weights": torch.cat([flat_weights(first), flat_weights(second)]),
                "hooked": len(attached.hooks) if attached else 0}

    return {
        "attach/two-models-plain": lambda: two_models(),
        "attach/two-models": lambda: two_models("hierarchical"),
        "nodes/ray": lambda: found_nodes({"NODE_RANK": str(node), "LOCAL_RANK": str(local)}),
        "nodes/slurm": lambda: found_nodes({"SLURM_NODEID": str(node), "SLURM_LOCALID": str(local)}),
        "nodes/hostname-two-machines": lambda: found_nodes({"LOCAL_RANK": str(local)}, host=f"machine-{node}"),
        "nodes/hostname-one-machine": lambda: found_nodes({"LOCAL_RANK": str(local)}),
        "refuse/not-ddp": lambda: hybrid.attach(nn.Linear(4, 4)),
        "refuse/already-hooked": already_hooked,
        "refuse/builtin-hook": builtin_hooked,
        "refuse/unknown-algorithm": lambda: hybrid.attach(ddp(), "butterfly"),
        "refuse/unknown-option": lambda: hybrid.attach(ddp(), "hierarchical", bucket_mb=5),
        "refuse/subgroup": over_a_node_group,
        "refuse/disagree": lambda: hybrid.attach(ddp(), "flat" if rank == 3 else "hierarchical", timeout_s=30),
    }


def main() -> None:
    dist.init_process_group("gloo")
    wanted = os.environ.get("INTEGRATION_CASES", "").split(",")
    results = {}
    for make in (attach_cases, lightning_cases, trainer_cases, accelerate_cases):
        for name, case in make().items():
            if wanted != [""] and not any(name.startswith(w) for w in wanted):
                continue
            try:
                results[name] = {"ok": case()}
            except Exception as exc:  # recorded for the test to read
                results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            if isinstance(results[name].get("ok"), Attached):
                results[name]["ok"].close()
                results[name] = {"ok": repr(results[name]["ok"])}
    torch.save(results, OUT / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
