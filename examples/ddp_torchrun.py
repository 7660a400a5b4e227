"""A plain torchrun DDP program with hybrid's two-level gradient reduce: one call after wrapping the model."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hybrid

dist.init_process_group("gloo")  # torchrun's RANK, WORLD_SIZE ...; on GPUs "nccl" and DDP(model.cuda(), device_ids=[...])
torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
ddp = DDP(model)
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
batches = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data

with hybrid.attach(ddp, algorithm="hierarchical") as comm:  # or "sharded", "flat", "auto"
    for _ in range(20):
        x = torch.randn(64, 32, generator=batches)
        loss = torch.nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        loss.backward()  # each bucket: reduce inside the node, all-reduce among node leaders, broadcast
        optimizer.step()
    calls = {phase: stats.calls for phase, stats in comm.counters.snapshot().items()}
    mean_loss = comm.communicator.all_reduce_mean_(loss.detach()).item()  # any tensor, averaged the same way
    checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"rank {dist.get_rank()} node {comm.topology.node}: mean loss {mean_loss:.4f}, weights {checksum:.6f}, {calls}")

dist.destroy_process_group()
