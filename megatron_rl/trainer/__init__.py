"""The training loop, optimizer set-up, checkpoints and metrics."""
