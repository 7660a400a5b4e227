"""What a run carries from step to step and across restarts: checkpoints (streamed ones, and every node's state
into rank 0's file), state moved to rank 0 and back, the membership history of an elastic run, recovery in place
(its agreement and the state held in memory), the stop at Slurm's warning, and the error-feedback residuals of
compressed communication."""
