"""Text in, text out over a ``RolloutEngine``: what an LLM judge (``rewards.judge``) runs on.

``EngineText(engine, tokenizer, sampling)`` turns each prompt into one ``GenerationRequest``
(through the tokenizer's chat template as one user turn when ``chat_template``), sends the
whole list in one ``generate`` call (the pool spreads it over its workers, restarts a dead or
hung worker and re-issues its requests: one result per request), and decodes each response.
``build_judge_text(settings, ...)`` starts engines of their own for it (``build_engine``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_rl.config.devices import parse_device
from megatron_rl.config.schema import RolloutConfig, SamplingConfig
from megatron_rl.config.schema_reward_model import JudgeConfig
from megatron_rl.rollout.build import build_engine
from megatron_rl.rollout.settings import EngineSettings
from megatron_rl.rollout.types import GenerationRequest, RolloutEngine, SamplingSettings


class EngineText:
    """``rewards.judge.TextBackend`` over an engine (see the module doc)."""

    def __init__(
        self, engine: RolloutEngine, tokenizer: Any, sampling: SamplingSettings, *, chat_template: bool, prefix: str
    ) -> None:
        """``prefix``: request ids are ``<prefix>:<n>``, n counting every request of the run."""
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{prefix}: the tokenizer has no chat template; set chat_template to false")
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.chat_template, self.prefix = chat_template, prefix
        self._ids = itertools.count()

    def encode(self, prompt: str) -> tuple[int, ...]:
        """The prompt's token ids as the engine receives them."""
        if self.chat_template:
            turn = [{"role": "user", "content": prompt}]
            ids = self.tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            return tuple(int(i) for i in ids)
        return tuple(self.tokenizer.encode(prompt, add_special_tokens=False))

    def complete(self, prompts: Sequence[str]) -> list[str]:
        """One completion per prompt, in prompt order."""
        requests = [
            GenerationRequest(
                request_id=f"{self.prefix}:{next(self._ids)}", prompt_ids=self.encode(p), sampling=self.sampling
            )
            for p in prompts
        ]
        by_id = {r.request_id: r for r in self.engine.generate(requests)}
        return [self.tokenizer.decode(by_id[r.request_id].response_ids, skip_special_tokens=True) for r in requests]

    def shutdown(self) -> None:
        """Stop the engine."""
        self.engine.shutdown()


def judge_text(judge: JudgeConfig, rollout: RolloutConfig) -> EngineText:
    """The judge's engines (reward.judge: model, engine, devices, dtype, batch; supervised with
    rollout's timeouts and restarts) and the ``EngineText`` over them."""
    if not judge.model or not Path(judge.model).is_dir():
        raise ValueError(f"reward.judge.model: {judge.model!r} is not a checkpoint directory")
    devices = list(judge.devices)
    first = parse_device(devices[0], "reward.judge.devices") if devices else None
    settings = EngineSettings(
        **{**vars(rollout), "vllm": {}, "engine_nodes": [], "record": None, "generator": "auto"},
        model_path=judge.model,
        model_dtype=judge.dtype,
    )
    settings = replace(
        settings,
        engine=judge.engine,
        num_engines=len(devices) or 1,
        devices=devices,
        tensor_parallel_size=len(first.ids) if first is not None and first.kind != "cpu" else 1,
        dtype=None,
        max_batch_size=judge.batch,
        sampling=SamplingConfig(**{**vars(rollout.sampling), "max_new_tokens": judge.max_new_tokens}),
    )
    return build_judge_text(
        settings, temperature=judge.temperature, max_new_tokens=judge.max_new_tokens, chat_template=judge.chat_template
    )


def build_judge_text(
    settings: EngineSettings, *, temperature: float, max_new_tokens: int, chat_template: bool
) -> EngineText:
    """Judge engines of their own from ``settings`` (model_path: the judge's checkpoint), and the
    ``EngineText`` over them; ``temperature`` 0 is greedy."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
    sampling = SamplingSettings(
        temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=stop, seed=settings.sampling.seed
    )
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"reward.judge.chat_template: the judge's tokenizer ({settings.model_path}) has no chat template; set it "
            "to false"
        )
    engine = build_engine(settings)
    return EngineText(engine, tokenizer, sampling, chat_template=chat_template, prefix="judge")
