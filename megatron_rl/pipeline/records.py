"""The records that cross the producer -> queue -> consumer boundary, and their one conversion
to tensors.

Flow: the producer turns each engine ``GenerationResult`` into a ``Sample`` (with its task
reward), collects a prompt's G samples into a ``ScoredGroup`` (shaped rewards, group
advantages, the dynamic-sampling verdict) and, after the batch's last group, a ``BatchEnd``
marker (every response length of the step, group counts, the prompt source's state). The
consumer turns kept groups into ``MicroBatch``es with ``make_micro_batch``: the only place
where samples become tensors.

Request ids are ``"<step>/<prompt_id>/<k>"``; the per-request seed is a hash of
(base seed, step, prompt_id, k), so re-runs and every pipeline mode draw the same samples.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_rl.attention.packing import PackedMicroBatch, TokenGroup, concat_groups, greedy_chunks, pack_group


class PipelineError(RuntimeError):
    """The producer thread failed or stopped early; ``__cause__`` holds the original error."""


def request_id(step: int, prompt_id: str, k: int) -> str:
    """Unique id of sample ``k`` of prompt ``prompt_id`` at ``step``: ``"<step>/<prompt_id>/<k>"``."""
    return f"{step}/{prompt_id}/{k}"


def request_seed(base_seed: int, step: int, prompt_id: str, k: int) -> int:
    """Deterministic 63-bit sampling seed of one request (blake2b of the four values)."""
    digest = hashlib.blake2b(f"{base_seed}|{step}|{prompt_id}|{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One scored response: what the engine sampled and the task reward it earned."""

    prompt_id: str
    request_id: str
    index: int  # k, the sample's place in its group (0-based)
    prompt_ids: tuple[int, ...]  # [Lp]
    response_ids: tuple[int, ...]  # [Lr], Lr >= 1
    behav_logprobs: tuple[float, ...]  # [Lr] log pi_behav of each response token
    weight_version: int  # policy version that generated every token
    finish_reason: Literal["stop", "length"]
    reward: float  # task reward from the reward function (before overlong shaping)

    def __post_init__(self) -> None:
        if not self.response_ids:
            raise ValueError(f"request {self.request_id!r}: the engine returned an empty response")
        if len(self.behav_logprobs) != len(self.response_ids):
            raise ValueError(
                f"request {self.request_id!r}: {len(self.behav_logprobs)} log-probs for "
                f"{len(self.response_ids)} response tokens"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class ScoredGroup:
    """A prompt's whole group, samples in index order (k = 0..G-1), scored."""

    step: int
    prompt_index: int  # position of the prompt in its batch (the canonical order)
    prompt_id: str
    samples: tuple[Sample, ...]  # [G]
    rewards: torch.Tensor  # [G] float32, task reward + overlong delta: what advantages use
    advantages: torch.Tensor  # [G] float32
    kept: bool  # False: dropped by dynamic sampling (all rewards equal); never trained

    @property
    def group_size(self) -> int:
        return len(self.samples)

    @property
    def num_packed_tokens(self) -> int:
        """Tokens of ``[prompt, r_1, ..., r_G]``: what the group costs in a micro-batch."""
        return len(self.samples[0].prompt_ids) + sum(len(s.response_ids) for s in self.samples)


@dataclass(frozen=True, kw_only=True)
class BatchEnd:
    """Marker after a batch's last group: what the controller observes and what was dropped."""

    step: int
    group_size: int  # G the batch was generated with
    response_lengths: tuple[int, ...]  # every response of the step (dropped groups included), prompt order
    groups_produced: int
    groups_dropped: int  # by dynamic sampling
    source_state: Mapping[str, Any] | None  # prompt source's state_dict() after drawing this batch
    generation_s: float = 0.0  # from the first request to the last result (generation + scoring)


QueueItem = ScoredGroup | BatchEnd


@dataclass(frozen=True, kw_only=True, eq=False)
class MicroBatch:
    """Kept groups packed as one shared-prompt micro-batch, with everything the loss needs.

    Response order (R responses, N response tokens) is that of ``packed``: group by group,
    sample by sample; per-token fields align with ``packed.logit_index``.
    """

    step: int
    policy_version: int  # version of the policy being trained on this micro-batch
    groups: tuple[ScoredGroup, ...]
    packed: PackedMicroBatch
    advantages: torch.Tensor  # [R] float32
    behav_logprobs: torch.Tensor  # [N] float32
    versions: torch.Tensor  # [R] int64, weight version that generated each response

    @property
    def token_advantages(self) -> torch.Tensor:
        """``[N]`` float32: each response's advantage repeated over its tokens."""
        return self._per_token(self.advantages)

    @property
    def token_versions(self) -> torch.Tensor:
        """``[N]`` int64: the generating version of every response token."""
        return self._per_token(self.versions)

    @property
    def staleness(self) -> torch.Tensor:
        """``[R]`` int64: policy_version - generating version (0 = on-policy)."""
        return self.policy_version - self.versions

    def _per_token(self, per_response: torch.Tensor) -> torch.Tensor:
        lens = torch.tensor(self.packed.response_lens, dtype=torch.int64)
        return per_response.repeat_interleave(lens)


def to_token_group(group: ScoredGroup) -> TokenGroup:
    """The group's token ids as a ``TokenGroup`` (prompt ``[Lp]``, G responses ``[Lr_i]``)."""
    return TokenGroup(
        prompt_ids=torch.tensor(group.samples[0].prompt_ids, dtype=torch.int64),
        response_ids=tuple(torch.tensor(s.response_ids, dtype=torch.int64) for s in group.samples),
    )


def make_micro_batch(groups: Sequence[ScoredGroup], *, policy_version: int) -> MicroBatch:
    """Pack kept groups (in the given order) into one ``MicroBatch``; no token budget check here."""
    if not groups:
        raise ValueError("make_micro_batch needs at least one group")
    if any(not g.kept for g in groups):
        raise ValueError("make_micro_batch got a group dropped by dynamic sampling")
    steps = {g.step for g in groups}
    if len(steps) != 1:
        raise ValueError(f"a micro-batch mixes steps {sorted(steps)}")
    samples = [s for g in groups for s in g.samples]
    return MicroBatch(
        step=groups[0].step,
        policy_version=policy_version,
        groups=tuple(groups),
        packed=concat_groups([pack_group(to_token_group(g)) for g in groups]),
        advantages=torch.cat([g.advantages.to(torch.float32) for g in groups]),
        behav_logprobs=torch.tensor([lp for s in samples for lp in s.behav_logprobs], dtype=torch.float32),
        versions=torch.tensor([s.weight_version for s in samples], dtype=torch.int64),
    )


def chunk_by_tokens(groups: Sequence[ScoredGroup], token_budget: int) -> list[list[ScoredGroup]]:
    """Greedy, order-preserving split into chunks of at most ``token_budget`` packed tokens."""
    chunks = greedy_chunks([g.num_packed_tokens for g in groups], token_budget,
                           name=lambda i: f"group {groups[i].prompt_id!r} (step {groups[i].step})")
    return [[groups[i] for i in chunk] for chunk in chunks]


def check_fits(group: ScoredGroup, token_budget: int) -> int:
    """The group's packed token count; ``ValueError`` if it exceeds ``micro_batch_tokens``."""
    n = group.num_packed_tokens
    if n > token_budget:
        raise ValueError(
            f"group {group.prompt_id!r} (step {group.step}) packs to {n} tokens, more than "
            f"micro_batch_tokens={token_budget}; raise it to at least max_prompt_len + G * max_new_tokens"
        )
    return n
