"""A tiny RL setting that runs in seconds: a tiny random Llama with a character-level tokenizer
(``megatron_rl.models.synthetic``) and a YAML config pointing at it (hf engine, reasoning_gym data)."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.rollout.engine_wrapper import EngineWrapper


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
        "data": {
            "source": "reasoning_gym:basic_arithmetic",
            "size": 32,
            "seed": 1,
            "chat_template": False,
            "max_prompt_tokens": 200,
        },
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


class ShuffledEngine(EngineWrapper):
    """Wraps a real engine and yields each batch's results in a seeded random order (the order in
    which a busy engine pool might finish them); records every permutation it applied."""

    def __init__(self, inner, seed: int = 0) -> None:
        import random

        super().__init__(inner)
        self.rng, self.permutations = random.Random(seed), []

    def generate(self, requests):
        results = list(self.inner.generate(requests))
        by_id = {r.request_id: r for r in results}
        order = [req.request_id for req in requests]
        self.rng.shuffle(order)
        self.permutations.append(order)
        yield from (by_id[i] for i in order)


class RecordingEngine(EngineWrapper):
    """Wraps a real engine and keeps every result it yields (``RECORDED``, per process), so a test
    can check the behaviour log-probs against an independent forward pass."""

    def generate(self, requests):
        for result in self.inner.generate(requests):
            RECORDED.append(result)
            yield result

    def generate_stream(self, feed):  # multi-turn: every turn's result
        for result in self.inner.generate_stream(feed):
            RECORDED.append(result)
            yield result


RECORDED: list = []


class LeadHoldingEngine(RecordingEngine):
    """A ``RecordingEngine`` that makes stale mode run ahead by exactly ``lead`` batches, however
    the cores are shared: ``load_weights(v)`` (the trainer moving the engine from θ_{v-1} to θ_v)
    first waits until ``results`` results of batch v-1+lead have come out, sampled at θ_{v-1}
    (the whole batch when ``results`` is its size); only while such a batch exists (``batches``).
    Timing alone (a trainer slower than generation) cannot promise that on a loaded machine."""

    def __init__(self, inner, *, lead: int, batches: int, results: int = 1, timeout_s: float = 120.0) -> None:
        super().__init__(inner)
        self.lead, self.batches, self.results, self.timeout_s = lead, batches, results, timeout_s

    def load_weights(self, update, version: int) -> None:
        from tests.pipeline_fakes import hold_until_ahead

        hold_until_ahead(
            RECORDED, version, lead=self.lead, batches=self.batches, count=self.results, timeout_s=self.timeout_s
        )
        super().load_weights(update, version)


def recording_factory(settings):
    from megatron_rl.rollout import build_engine

    return RecordingEngine(build_engine(settings))


# Training tests run on the emulated accelerator under the Ascend 910B profile (the first target):
# device tensors on ``emulated:<rank>``, host tensors refused in device ops and in the ``eccl``
# collectives, no float64 computed on the device, HCCL's collective dtypes, ``torch.npu.*`` type
# names and the NPU adaptor path (``megatron_rl.platform.emulated.profiles``). A handful of tests
# run under CUDA's rules (``CUDA_PLATFORM``); ``MEGATRON_RL_PLATFORM=cpu`` overrides both for debugging.
TRAIN_PLATFORM = "emulated-npu"
CUDA_PLATFORM = "emulated"


def train_run(config_path: str, overrides: list[str] = (), replay: str | None = None) -> list[dict]:
    """A rank's body (``run_distributed(train_run, world, config, overrides)``): train on
    ``TRAIN_PLATFORM`` from ``config_path`` + ``overrides`` (``replay``: a recording to train on);
    the metric history."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    return train(load_config(config_path, list(overrides)), platform=TRAIN_PLATFORM, replay=replay)


def train_recorded(config_path: str, overrides: list[str]):
    """A rank's body: train with a recording engine; return (history, the leader's engine results)."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    history = train(load_config(config_path, overrides), platform=TRAIN_PLATFORM, engine_factory=recording_factory)
    return history, list(RECORDED)


def lead_holding_factory(cfg, lead: int, *, whole_batch: bool = False):
    """An engine factory of ``LeadHoldingEngine``s for the run ``cfg`` (fixed G): stale mode runs
    ``lead`` batches ahead, with the whole batch sampled ahead when ``whole_batch``."""
    from megatron_rl.rollout import build_engine

    results = cfg.trainer.prompts_per_batch * cfg.control.group_size if whole_batch else 1

    def factory(settings):
        return LeadHoldingEngine(build_engine(settings), lead=lead, batches=cfg.trainer.steps, results=results)

    return factory


def train_recorded_ahead(config_path: str, overrides: list[str], lead: int):
    """``train_recorded`` with a ``LeadHoldingEngine``: stale mode reaches staleness ``lead``."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    cfg = load_config(config_path, overrides)
    history = train(cfg, platform=TRAIN_PLATFORM, engine_factory=lead_holding_factory(cfg, lead))
    return history, list(RECORDED)


def teacher_forced_logprobs(model_dir, pairs) -> list[list[float]]:
    """For each (prompt ids, response ids): log_softmax of each response token under transformers
    (fp32, temperature 1), from the checkpoint at ``model_dir``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    out = []
    for prompt, response in pairs:
        ids = torch.tensor([tuple(prompt) + tuple(response)])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist())
    return out


def load_weights(path) -> dict:
    """Every tensor of the safetensors files in ``path`` (a HF checkpoint directory)."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(file))
    return out
