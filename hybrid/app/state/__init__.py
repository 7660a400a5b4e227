"""What a run carries from step to step and across restarts: checkpoints, the membership history of an
elastic run, and the error-feedback residuals of compressed communication."""
