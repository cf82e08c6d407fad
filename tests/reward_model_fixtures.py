"""A tiny sequence-classification reward model (random Llama, one label, the char tokenizer of
``megatron_rl.models.synthetic``) and scorers that plant faults in its worker process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from megatron_rl.rewards.model_reward import SequenceClassifier

FAULT_DIR = "MEGATRON_RL_TEST_REWARD_FAULT_DIR"  # where a once-only fault leaves its marker


def make_tiny_reward_model(path: Path, *, seed: int = 0) -> Path:
    """Save a random 2-layer Llama sequence classifier (num_labels 1) with the char tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from megatron_rl.models.synthetic import char_tokenizer

    tokenizer = char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(cfg)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # varied rewards, not ~0 for every text
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _once(name: str) -> bool:
    """True the first time ``name`` fires in this test run (a marker file in FAULT_DIR)."""
    try:
        os.close(os.open(Path(os.environ[FAULT_DIR]) / name, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


class CrashOnceScorer(SequenceClassifier):
    """Dies (exit code 9) in the middle of its first batch of the run; then scores normally."""

    def score(self, records, texts):
        if _once("crash"):
            os._exit(9)
        return super().score(records, texts)


class AlwaysCrashScorer(SequenceClassifier):
    """Dies in every batch."""

    def score(self, records, texts):
        os._exit(9)


class HangOnceScorer(SequenceClassifier):
    """Hangs in its first batch of the run; then scores normally."""

    def score(self, records, texts):
        if _once("hang"):
            time.sleep(600)
        return super().score(records, texts)
