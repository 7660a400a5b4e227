"""A PyTorch Lightning program (strategy="ddp") with hybrid's two-level gradient reduce: one callback."""
import pytorch_lightning as pl
import torch
from torch import nn

from hybrid.integrations.lightning import HybridCommCallback


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    hybrid_comm = HybridCommCallback("hierarchical")  # or "sharded", "flat", "auto"
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy="ddp",  # on GPUs: accelerator="gpu"
                         max_epochs=1, accumulate_grad_batches=2, callbacks=[hybrid_comm],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Regressor(), data)
    calls = {phase: stats.calls for phase, stats in hybrid_comm.counters.snapshot().items()}
    print(f"rank {trainer.global_rank} node {trainer.node_rank}: {calls}")
    torch.distributed.destroy_process_group()  # leaves the process group before exit
