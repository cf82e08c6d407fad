"""``reward.kind: model``: a sequence-classification reward model scored in worker processes of its own.

Contract: ``RewardModelReward(settings, timeout_s=...)`` is a ``batched.BatchedReward``: one
worker process per device in ``settings.devices`` loads ``settings.path`` with transformers'
``AutoModelForSequenceClassification`` (one label) and its tokenizer, and scores the batches one
lane sends it. A response's reward is the model's logit for ``reward_text(record, response)``:
the prompt's chat turns plus the response as the assistant's turn, through the tokenizer's chat
template, or the prompt text, a newline and the response when it has none. Batches are padded
on the right, so a padded row's logit is the unpadded one (the causal mask keeps padding out).

Failures: a batch running longer than ``timeout_s`` (reward.timeout_s) has its worker killed and
replaced; its calls score 0, counted as ``timeout``. A worker that dies mid-batch (killed from
outside, the OOM killer) is replaced and the batch sent once more to the new worker
(``process_worker.ProcessWorker``); if that one dies too, the calls score 0, counted as
``crashed``. Every call is answered exactly once. An exception in the model's forward is counted
as ``raised`` for each call of the batch. A worker that cannot load the model stops the run
(``RuntimeError`` naming reward.model.path).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_rl.config.devices import parse_device
from megatron_rl.config.resources import find_dotted
from megatron_rl.config.schema_reward_model import RewardModelConfig
from megatron_rl.data.records import PromptRecord
from megatron_rl.rewards.batched import BatchedReward, Call
from megatron_rl.rewards.process_worker import Answer, ProcessWorker, WorkerSetup, serve

CLASSIFIER = "megatron_rl.rewards.model_reward:SequenceClassifier"


@dataclass(frozen=True, kw_only=True)
class ScorerSetup:
    """What one worker loads: the checkpoint, its device and dtype, and the scorer class."""

    path: str
    device: str  # a reward.model.devices string: "cpu", "cpu:0-3" (pinned cores), "cuda:1", "npu:0"
    dtype: str
    scorer: str = CLASSIFIER  # "pkg.mod:Class" built from this setup, with score(records, texts) -> floats


def reward_text(record: PromptRecord, response: str, tokenizer: Any) -> str:
    """The text the reward model reads for ``response`` to ``record`` (see module doc)."""
    if getattr(tokenizer, "chat_template", None):
        turns = [{"role": m.role, "content": m.content} for m in record.chat()]
        turns.append({"role": "assistant", "content": response})
        return tokenizer.apply_chat_template(turns, tokenize=False)
    return f"{prompt_text(record)}\n{response}"


def prompt_text(record: PromptRecord) -> str:
    """The task as text: the plain prompt, or the chat's turns joined by blank lines."""
    if record.text is not None:
        return record.text
    return "\n\n".join(m.content for m in record.chat())


class SequenceClassifier:
    """A transformers sequence-classification model with one label, in eval mode on one device."""

    def __init__(self, setup: ScorerSetup) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = parse_device(setup.device, "reward.model.devices")
        if device.kind == "cpu" and device.ids:
            os.sched_setaffinity(0, device.ids)
        if device.kind == "npu":
            import torch_npu  # noqa: F401 (registers the npu device)
        where = "cpu" if device.kind == "cpu" else f"{device.kind}:{device.ids[0]}"
        self.tokenizer = AutoTokenizer.from_pretrained(setup.path)
        self.tokenizer.padding_side = "right"
        dtype = getattr(torch, setup.dtype)
        self.model = AutoModelForSequenceClassification.from_pretrained(setup.path, dtype=dtype).to(where).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward.model.path {setup.path!r} has num_labels={self.model.config.num_labels}; a reward "
                "model has one label (its logit is the reward)"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = where

    def score(self, records: Sequence[PromptRecord], texts: Sequence[str]) -> list[float]:
        """The logit of each (record, response text), batched."""
        import torch

        inputs = [reward_text(r, t, self.tokenizer) for r, t in zip(records, texts, strict=True)]
        batch = self.tokenizer(inputs, padding=True, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            logits = self.model(**batch.to(self.device)).logits
        return logits[:, 0].float().tolist()


def _worker_main(setup: ScorerSetup, conn) -> None:
    """A worker process: build the scorer, then answer batches (``process_worker.serve``)."""
    serve(conn, lambda: _handler(setup))


def _handler(setup: ScorerSetup) -> Callable[[tuple[list[PromptRecord], list[str]]], Answer]:
    """The scorer of ``setup`` as a batch handler: ``("value", [floats], "")``."""
    cls, why = find_dotted(setup.scorer)
    if why:
        raise ImportError(why)
    scorer = cls(setup)
    return lambda message: ("value", scorer.score(*message), "")


def _worker(setup: ScorerSetup, start_timeout_s: float) -> ProcessWorker:
    """A reward-model worker: a ``spawn``ed process (the trainer holds threads: never fork it)."""
    return ProcessWorker(
        WorkerSetup(
            target=_worker_main,
            arg=setup,
            context="spawn",
            name="megatron_rl-reward-model",
            what=f"reward.model.path {setup.path!r}: the reward-model worker on {setup.device!r}",
            start_timeout_s=start_timeout_s,
        )
    )


class RewardModelReward(BatchedReward):
    """``reward.kind: model`` (see the module doc)."""

    def __init__(
        self,
        settings: RewardModelConfig,
        *,
        timeout_s: float | None,
        scorer: str = CLASSIFIER,
        start_timeout_s: float = 600.0,
    ) -> None:
        """``scorer``: the class each worker builds (the transformers classifier; tests plant faults here)."""
        if not settings.path:
            raise ValueError("reward.model.path: a reward model needs its checkpoint directory")
        if not settings.devices:
            raise ValueError("reward.model.devices: give one device string per worker, e.g. ['cpu']")
        super().__init__(name="model", timeout_s=timeout_s, batch=settings.batch, lanes=len(settings.devices))
        self.workers = [
            _worker(ScorerSetup(path=settings.path, device=d, dtype=settings.dtype, scorer=scorer), start_timeout_s)
            for d in settings.devices
        ]
        for worker in self.workers:  # load now: a bad checkpoint fails before the first rollout
            worker.start()
        self.start()

    def _score_batch(self, lane: int, calls: Sequence[Call]) -> list[Answer]:
        worker = self.workers[lane]
        message = ([c.record for c in calls], [c.text for c in calls])
        answer = worker.call(message, self.timeout_s)
        if answer[0] == "crashed":  # once more, on the replacement (see module doc)
            answer = worker.call(message, self.timeout_s)
        kind, value, trace = answer
        if kind != "value":
            return [(kind, value, trace)] * len(calls)
        return [("value", v, "") for v in value]

    def _release(self) -> None:
        for worker in self.workers:
            worker.close()
