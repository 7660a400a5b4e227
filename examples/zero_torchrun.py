"""A torchrun DDP program whose AdamW is sharded inside each node (ZeRO-1 within the node) by hybrid."""
import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hybrid

dist.init_process_group("gloo")  # torchrun's RANK, WORLD_SIZE ...; on GPUs "nccl" and DDP(model.cuda(), device_ids=[...])
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
ddp = DDP(model, gradient_as_bucket_view=True)  # the shards' weights are gathered through DDP's buckets
adamw = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01)  # any elementwise torch.optim class
batches = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data

with hybrid.connect("sharded") as comm:  # or "hierarchical"
    optimizer = comm.shard_optimizer(ddp, adamw)  # in place of adamw(ddp.parameters())
    for _ in range(20):
        x = torch.randn(64, 32, generator=batches)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        loss.backward()  # each bucket: reduce-scatter in the node, each shard all-reduced across nodes
        optimizer.clip_grad_norm_(1.0)  # the global norm, from the shards
        optimizer.step()  # this worker's shard of AdamW, then the node gathers the updated weights
        optimizer.zero_grad()
    state = optimizer.state_dict()  # torch's own form, whole tensors, on rank 0 (collective in its node)
    calls = {phase: stats.calls for phase, stats in comm.counters.snapshot().items()}
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"rank {dist.get_rank()} node {comm.topology.node}: loss {loss.item():.4f}, weights {checksum:.6f}, "
          f"AdamW state {optimizer.state_bytes()} of {2 * 4 * sum(p.numel() for p in model.parameters())} bytes, "
          f"state_dict {len(state['state'])} tensors, {calls}")

dist.destroy_process_group()
