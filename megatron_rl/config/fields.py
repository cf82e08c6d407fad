"""One-field rules, by dotted key: the value's type (the schema's annotation) and its bound.

Contract: `check_value(key, value)` yields ``(key, message)`` when the schema's field `key`
does not accept `value`: a wrong type or a name outside a ``Literal`` (the converter's own
check, so a component built from Python gets the message a YAML file gets), or a value outside
its bound in `BOUNDS` (``None`` passes where the annotation allows it). `sections.py` runs it
on every field of a section; component settings classes run it on the fields they carry. These
bounds are written nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .convert import field_types, type_problems
from .errors import ConfigError, Problem
from .schema import Config

Found = Iterator[tuple[str, str]]  # (dotted key, message) pairs yielded by a check

# fmt: off
POSITIVE = (
    "model.make_vocab_size_divisible_by", "parallel.tp", "parallel.pp", "parallel.dp", "parallel.timeout_s",
    "parallel.ep", "parallel.cp",
    "rollout.num_engines", "rollout.tensor_parallel_size", "rollout.max_batch_size",
    "rollout.sampling.max_new_tokens", "rollout.sampling.temperature", "pipeline.queue_size",
    "pipeline.micro_batch_tokens", "control.group_size", "data.size", "data.max_prompt_tokens",
    "trainer.steps", "trainer.prompts_per_batch", "trainer.mini_batches", "trainer.lr",
    "trainer.max_nonfinite_steps", "algorithm.advantage.eps", "algorithm.temperature",
    "control.sagc.eta", "control.sagc.lambda_max", "control.sagc.prior_alpha", "control.sagc.prior_beta",
    "rollout.request_timeout_s", "rollout.start_timeout_s", "reward.timeout_s", "rollout.sync_bucket_mb",
    "rollout.engine_port",
    "trainer.logprob_chunk_tokens", "algorithm.rollout_correction.c_min", "algorithm.rollout_correction.c_max",
    "environment.max_turns", "environment.max_total_tokens", "environment.step_timeout_s",
    "reward.judge.max_new_tokens", "reward.judge.batch", "reward.model.batch",
)
NON_NEGATIVE = (
    "pipeline.max_staleness", "trainer.save_every", "trainer.weight_decay", "trainer.grad_clip",
    "algorithm.overlong.buffer", "algorithm.overlong.penalty", "algorithm.kl.coef",
    "algorithm.entropy_coef", "rollout.max_restarts", "reward.workers", "control.sagc.seed",
    "algorithm.rollout_correction.delta", "algorithm.rollout_correction.probe_sequences",
    "algorithm.mismatch_alarm.logprob_abs_diff_mean",
    "algorithm.mismatch_alarm.logprob_abs_diff_max", "algorithm.mismatch_alarm.kl_k3",
    "algorithm.mismatch_alarm.seq_ratio_max", "algorithm.mismatch_alarm.masked_fraction",
    "environment.max_failures", "model.moe.aux_loss_coeff", "model.moe.z_loss_coeff",
    "reward.judge.temperature",
    "lora.rank", "lora.seed",
)
# fmt: on
BOUNDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(POSITIVE, (lambda v: v > 0, "must be > 0")),
    **dict.fromkeys(NON_NEGATIVE, (lambda v: v >= 0, "must be >= 0")),
    "rollout.sampling.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "trainer.adam_beta1": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "trainer.adam_beta2": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "algorithm.clip.low": (lambda v: 0 < v < 1, "must be in (0, 1)"),
    "algorithm.oversample": (lambda v: v >= 1, "must be >= 1 (1: no over-sampling)"),
    "algorithm.behav_weight_cap": (lambda v: v > 1, "must be > 1 (a cap on π_prox/π_behav), or null for no cap"),
    # the streaming pipeline scores each group as it completes; refused before launch
    "algorithm.advantage.scale": (
        lambda v: v != "batch",
        "must be 'group' or 'none' ('batch' needs the whole "
        "batch before the first group can train, which defeats periodic asynchrony)",
    ),
    "control.sagc.tau": (lambda v: v > 1, "must be > 1 (a ratio max/median response length)"),
    "control.sagc.delta": (lambda v: 0 < v < 1, "must be in (0, 1) (a target rate)"),
    "control.sagc.gamma": (lambda v: 0 < v <= 1, "must be in (0, 1] (a forgetting factor)"),
    "lora.alpha": (lambda v: v > 0, "must be > 0 (the adapter scale is lora.alpha / lora.rank)"),
    "lora.dropout": (lambda v: 0 <= v < 1, "must be in [0, 1) (dropout on the adapters' input)"),
}


@functools.cache
def schema_type(key: str) -> Any:
    """The annotation of the schema field at dotted `key` (``KeyError`` for a key not in it)."""
    node: Any = Config
    for part in key.split("."):
        node = field_types(node)[part]
    return node


def check_value(key: str, value: Any) -> Found:
    """Problems of `value` as the schema's field `key`: its type, then its bound."""
    tp = schema_type(key)
    if dataclasses.is_dataclass(tp):
        return  # a section: `sections.check_section` walks it
    wrong = type_problems(tp, value, key)
    if wrong:
        yield from wrong
        return
    bound = BOUNDS.get(key)
    if bound is not None and value is not None and not bound[0](value):
        yield key, f"{bound[1]}, got {value!r}"


def raise_found(found: Found) -> None:
    """Raise one `ConfigError` (a ``ValueError``) listing every problem found, if any."""
    problems = [Problem(key=k, message=m) for k, m in found]
    if problems:
        raise ConfigError(problems)


def require_values(values: Mapping[str, Any]) -> None:
    """Check each dotted key's value (components carrying config values under other names)."""
    raise_found(p for key, value in values.items() for p in check_value(key, value))
