"""An accelerate training loop with hybrid's two-level gradient reduce: attach to what accelerator.prepare made."""
import torch
from accelerate import Accelerator

import hybrid

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)  # on GPUs: Accelerator(gradient_accumulation_steps=2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x = torch.randn(512, 32)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
model, optimizer, data = accelerator.prepare(model, optimizer, data)

with hybrid.attach(model, algorithm="hierarchical") as comm:  # or "sharded", "flat", "auto"
    for inputs, targets in data:
        with accelerator.accumulate(model):  # no_sync between optimizer steps: gradients travel once per step
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    calls = {phase: stats.calls for phase, stats in comm.counters.snapshot().items()}
    print(f"rank {accelerator.process_index}: loss {loss.item():.4f}, {calls}")
accelerator.end_training()  # leaves the process group before exit
