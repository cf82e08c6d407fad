"""Parallel state (megatron-core), TP/PP helpers, vocab-parallel log-probs and weight gathering."""
