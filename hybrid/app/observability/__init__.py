"""What a run reports: TensorBoard and metrics.json writers, the end-of-run metrics, every rank's step
accounts (stragglers) and the timeline file."""
