"""Command-line tools around the trainer: collective and training benchmarks, the sweep report, the cost
model's CLI. The top of the layers: they may import everything below, nothing imports them."""
