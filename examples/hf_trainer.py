"""The Hugging Face Trainer on several processes with hybrid's two-level gradient reduce: one callback."""
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from hybrid.integrations.transformers import HybridCommCallback

# gpt2's architecture, small and randomly initialised (nothing to download), on hybrid's README, a byte a token
text = (Path(__file__).resolve().parents[1] / "README.md").read_bytes()
rows = torch.tensor(list(text[: 64 * 64]), dtype=torch.long).view(64, 64)
dataset = [{"input_ids": row, "labels": row} for row in rows]
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=128, n_layer=2, n_head=2))

hybrid_comm = HybridCommCallback("hierarchical")  # or "sharded", "flat", "auto"
args = TrainingArguments(output_dir=tempfile.gettempdir(), use_cpu=True,  # nothing is saved; on GPUs: drop use_cpu
                         per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=8,
                         ddp_find_unused_parameters=False, report_to="none", save_strategy="no", logging_steps=4)
trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[hybrid_comm])
trainer.train()
calls = {phase: stats.calls for phase, stats in hybrid_comm.counters.snapshot().items()}
print(f"rank {args.process_index}: {calls}")
trainer.accelerator.end_training()  # leaves the process group before exit
