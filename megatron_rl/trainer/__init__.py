"""Trainer: the RL loop, the policy replica per rank, optimizer, checkpoints, metrics, composition root."""
