"""What a run reports: TensorBoard and metrics.json writers, the end-of-run metrics, every rank's step
accounts (stragglers), the timeline file, the run's log (train.log, its first line) and the names of run
directories (TensorBoard's run names)."""
