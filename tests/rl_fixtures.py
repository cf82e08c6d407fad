"""A tiny RL setting that runs in seconds: a tiny random Llama with a character-level tokenizer
(``megatron_rl.models.synthetic``) and a YAML config pointing at it (hf engine, reasoning_gym data)."""

from __future__ import annotations

from pathlib import Path


def make_tiny_rl_model(path: Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Tiny random Llama (head_dim 32, 2 KV heads: TP 1 or 2) with the char tokenizer at ``path``."""
    from megatron_rl.models.synthetic import write_char_llama

    return write_char_llama(path, hidden=64, layers=layers, heads=2, kv_heads=2, seed=seed)


def tiny_rl_config(tmp: Path, model: Path, **sections) -> Path:
    """Write a small config YAML for ``model``; ``sections`` override top-level YAML sections."""
    import yaml

    cfg = {
        "model": {"hf_path": str(model), "dtype": "float32"},
        "attention": {"backend": "split"},
        "algorithm": {"loss": "grpo"},
        "rollout": {"engine": "hf", "num_engines": 1, "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 3}},
        "pipeline": {"mode": "periodic", "micro_batch_tokens": 256},
        "control": {"kind": "fixed", "group_size": 4},
        "data": {"source": "reasoning_gym:basic_arithmetic", "size": 32, "seed": 1, "chat_template": False,
                 "max_prompt_tokens": 200},
        "reward": {"fn": "exact_match"},
        "trainer": {"steps": 3, "prompts_per_batch": 3, "lr": 1e-3, "seed": 5},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def digit_share_reward(record, response_text: str) -> float:
    """A deterministic, varied reward for tests: the share of digits in the response."""
    return sum(c.isdigit() for c in response_text) / max(len(response_text), 1)


class ShuffledEngine:
    """Wraps a real engine and yields each batch's results in a seeded random order (the order in
    which a busy engine pool might finish them); records every permutation it applied."""

    def __init__(self, inner, seed: int = 0) -> None:
        import random

        self.inner, self.rng, self.permutations = inner, random.Random(seed), []

    def generate(self, requests):
        results = list(self.inner.generate(requests))
        by_id = {r.request_id: r for r in results}
        order = [req.request_id for req in requests]
        self.rng.shuffle(order)
        self.permutations.append(order)
        yield from (by_id[i] for i in order)

    def update_weights(self, snapshot_dir: str, version: int) -> None:
        self.inner.update_weights(snapshot_dir, version)

    def update_weights_from_tensors(self, named_tensors, version: int) -> None:
        self.inner.update_weights_from_tensors(named_tensors, version)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def shutdown(self) -> None:
        self.inner.shutdown()
