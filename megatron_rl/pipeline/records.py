"""The records that cross the producer -> queue -> consumer boundary, and their one conversion
to tensors.

Flow: before generating a batch the producer puts a ``BatchStart`` (how many prompts, which
G); it turns each generated ``Trajectory`` into a ``Sample`` with its task reward
(``sample_from``, the one conversion), collects a prompt's G samples into a ``ScoredGroup``
(shaped rewards, group advantages, the dynamic-sampling verdict) and, after the batch's last
group, a ``BatchEnd`` marker (every response length of the step, group counts, the prompt
source's state, what the group-size controller observed). The consumer turns kept groups into
``MicroBatch``es with ``make_micro_batch``: the only place where samples become tensors. A
group that packs to more tokens than a micro-batch holds is split by ``split_group`` into parts
that share its prompt (its advantages were computed on the whole group, so the loss is unchanged).

Request ids are ``"<step>/<prompt_id>/<k>"``; the per-request seed is a hash of
(base seed, step, prompt_id, k), so re-runs and every pipeline mode draw the same samples
(``generation.base.request_id`` / ``request_seed``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from megatron_rl.attention.packing import PackedMicroBatch, TokenGroup, concat_groups, greedy_chunks, pack_group
from megatron_rl.generation.base import PromptItem, Trajectory
from megatron_rl.rollout.types import RoutedExperts, check_token_versions


class PipelineError(RuntimeError):
    """The producer thread failed or stopped early; ``__cause__`` holds the original error."""


def put_unless_stopped(out: queue.Queue, item: QueueItem, stop: threading.Event, poll_s: float) -> bool:
    """Put ``item`` on the bounded queue, waiting while it is full; False if ``stop`` was set first
    (re-checked every ``poll_s``, so a stopped producer never blocks on a full queue)."""
    while not stop.is_set():
        try:
            out.put(item, timeout=poll_s)
            return True
        except queue.Full:
            continue
    return False


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One scored response: what the engine sampled and the task reward it earned."""

    prompt_id: str
    request_id: str
    index: int  # k, the sample's place in its group (0-based)
    prompt_ids: tuple[int, ...]  # [Lp]
    response_ids: tuple[int, ...]  # [Lr], Lr >= 1
    behav_logprobs: tuple[float, ...]  # [Lr] log pi_behav of each response token
    weight_version: int  # policy version that generated the first token (every token unless token_versions)
    finish_reason: Literal["stop", "length"]
    reward: float  # task reward from the reward function (before overlong shaping)
    # Multi-turn trajectories (generation.multi_turn): the response holds model turns and the
    # observations spliced between them; single-turn samples keep these defaults.
    loss_mask: tuple[int, ...] | None = None  # [Lr] 1 = model token (trained), 0 = observation (no gradient)
    turns: int = 1  # model turns
    tool_calls: int = 0  # tool calls the environment parsed from the model's turns
    tool_errors: int = 0  # of which failed
    env_failures: int = 0  # environment calls that raised or timed out (the trajectory ended there)
    env_s: float = 0.0  # seconds in environment calls
    truncated: bool = False  # ended by environment.max_turns / max_total_tokens, not by the environment
    turn_prompt_tokens: int = 0  # sum over its model turns of each turn's prompt length
    cached_tokens: int | None = None  # of those, the engine's prefix cache served (None: not reported)
    routed_experts: RoutedExperts | None = None  # MoE: experts of the Lp + Lr - 1 forwarded tokens (routing replay)
    # On-policy distillation (pipeline.teacher): [Lr] log pi_teacher of each response token; None: not scored
    teacher_logprobs: tuple[float, ...] | None = None
    # In-flight weight updates: [Lr] the version that sampled each response token (observation
    # tokens carry their turn's); None: every token at weight_version
    token_versions: tuple[int, ...] | None = None

    @property
    def versions_per_token(self) -> tuple[int, ...]:
        """``[Lr]`` the version that sampled each response token (``weight_version`` throughout
        when ``token_versions`` is None)."""
        if self.token_versions is not None:
            return self.token_versions
        return (self.weight_version,) * len(self.response_ids)

    def __post_init__(self) -> None:
        check_token_versions(self.request_id, self.token_versions, len(self.response_ids), self.weight_version)
        if not self.response_ids:
            raise ValueError(f"request {self.request_id!r}: the engine returned an empty response")
        if self.loss_mask is not None and (
            len(self.loss_mask) != len(self.response_ids) or not set(self.loss_mask) <= {0, 1}
        ):
            raise ValueError(f"request {self.request_id!r}: loss_mask must be 0/1 per response token")
        forwarded = len(self.prompt_ids) + len(self.response_ids) - 1
        if self.routed_experts is not None and self.routed_experts.num_tokens != forwarded:
            raise ValueError(
                f"request {self.request_id!r}: routes for {self.routed_experts.num_tokens} tokens, "
                f"the engine forwarded {forwarded} (prompt + response - 1)"
            )
        if len(self.behav_logprobs) != len(self.response_ids):
            raise ValueError(
                f"request {self.request_id!r}: {len(self.behav_logprobs)} log-probs for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != len(self.response_ids):
            raise ValueError(
                f"request {self.request_id!r}: {len(self.teacher_logprobs)} teacher log-probs for "
                f"{len(self.response_ids)} response tokens"
            )


def sample_from(trajectory: Trajectory, item: PromptItem, reward: float) -> Sample:
    """The ``Sample`` of a generated ``trajectory`` of prompt ``item`` with its task ``reward``:
    the one place a generator's output becomes a pipeline record."""
    return Sample(
        prompt_id=item.record.prompt_id,
        request_id=trajectory.request_id,
        index=trajectory.k,
        prompt_ids=trajectory.prompt_ids,
        response_ids=trajectory.response_ids,
        behav_logprobs=trajectory.behav_logprobs,
        weight_version=trajectory.turn_versions[0],
        finish_reason=trajectory.finish_reason,
        reward=reward,
        loss_mask=trajectory.loss_mask,
        turns=trajectory.turns,
        tool_calls=trajectory.tool_calls,
        tool_errors=trajectory.tool_errors,
        env_failures=trajectory.env_failures,
        env_s=trajectory.env_s,
        truncated=trajectory.truncated,
        turn_prompt_tokens=trajectory.turn_prompt_tokens,
        cached_tokens=trajectory.cached_tokens,
        routed_experts=trajectory.routed_experts,
        token_versions=trajectory.token_versions,
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
class BatchStart:
    """Marker before a batch's first group: its size, which fixes the mini-batch membership."""

    step: int
    num_prompts: int  # prompts of the batch; prompt_index of its groups is in [0, num_prompts)
    group_size: int  # G the batch is generated with


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
    reward_s: float = 0.0  # of which in the reward function (the producer thread scores as results arrive)
    # The group-size controller's view right after observing this batch (the producer owns the
    # controller: an observation is credited to the G that produced it, in every mode).
    control_metrics: Mapping[str, float] = field(default_factory=dict)
    controller_state: Mapping[str, Any] = field(default_factory=dict)  # resume from here
    distill_metrics: Mapping[str, float] = field(default_factory=dict)  # the teacher's timings (pipeline.teacher)


QueueItem = BatchStart | ScoredGroup | BatchEnd


@dataclass(frozen=True, kw_only=True, eq=False)
class MicroBatch:
    """Kept groups packed as one shared-prompt micro-batch, with everything the loss needs.

    Response order (R responses, N response tokens) is that of ``packed``: group by group,
    sample by sample; per-token fields align with ``packed.logit_index``.
    """

    step: int
    policy_version: int  # version of the policy being trained on this micro-batch
    mini_batch: int  # which optimizer step of the batch it belongs to (0-based, prompt order)
    groups: tuple[ScoredGroup, ...]  # whole groups or parts of one (``split_group``)
    packed: PackedMicroBatch
    advantages: torch.Tensor  # [R] float32
    behav_logprobs: torch.Tensor  # [N] float32
    versions: torch.Tensor  # [R] int64, weight version of each response's first token (its oldest)
    replica: int = 0  # DP replica that trains it (``pipeline.dispatch``)
    # [N] bool, True = model token; None: every response token is (single-turn). Observation
    # tokens of multi-turn trajectories are False: no policy term, KL, entropy or mismatch there.
    loss_mask: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None  # [N] float32 log pi_teacher (distillation); None: no teacher
    # [N] int64, the version that sampled each response token (in-flight weight updates make it
    # vary inside a response); None: each response's ``versions`` entry over its tokens
    per_token_versions: torch.Tensor | None = None

    @property
    def token_advantages(self) -> torch.Tensor:
        """``[N]`` float32: each response's advantage repeated over its tokens."""
        return self._per_token(self.advantages)

    @property
    def token_versions(self) -> torch.Tensor:
        """``[N]`` int64: the version that sampled every response token."""
        if self.per_token_versions is not None:
            return self.per_token_versions
        return self._per_token(self.versions)

    @property
    def staleness(self) -> torch.Tensor:
        """``[R]`` int64: policy_version - the version of each response's first token (its largest
        staleness; 0 = on-policy)."""
        return self.policy_version - self.versions

    @property
    def token_staleness(self) -> torch.Tensor:
        """``[N]`` int64: policy_version - the version that sampled each response token."""
        return self.policy_version - self.token_versions

    def _per_token(self, per_response: torch.Tensor) -> torch.Tensor:
        lens = torch.tensor(self.packed.response_lens, dtype=torch.int64).to(per_response.device)
        return per_response.repeat_interleave(lens)

    def to(self, device: torch.device) -> MicroBatch:
        """What a micro-step reads, on ``device``: the packed tensors, advantages, behaviour
        log-probs and versions, each copied once (non-blocking). ``groups`` stay on the host."""
        return replace(
            self,
            packed=self.packed.to(device),
            advantages=self.advantages.to(device, non_blocking=True),
            behav_logprobs=self.behav_logprobs.to(device, non_blocking=True),
            versions=self.versions.to(device, non_blocking=True),
            per_token_versions=None
            if self.per_token_versions is None
            else self.per_token_versions.to(device, non_blocking=True),
            loss_mask=None if self.loss_mask is None else self.loss_mask.to(device, non_blocking=True),
            teacher_logprobs=None
            if self.teacher_logprobs is None
            else self.teacher_logprobs.to(device, non_blocking=True),
        )


def to_token_group(group: ScoredGroup) -> TokenGroup:
    """The group's token ids as a ``TokenGroup`` (prompt ``[Lp]``, G responses ``[Lr_i]``)."""
    return TokenGroup(
        prompt_ids=torch.tensor(group.samples[0].prompt_ids, dtype=torch.int64),
        response_ids=tuple(torch.tensor(s.response_ids, dtype=torch.int64) for s in group.samples),
        **_group_routes(group),
    )


def _group_routes(group: ScoredGroup) -> dict[str, Any]:
    """``prompt_routes`` / ``response_routes`` of a group whose samples carry routes ({} if none do).
    The prompt is packed once: its routes are sample 0's. A response's last token was never
    forwarded by the engine: it repeats the previous token's route (no token attends to it and
    its logits score nothing, so the choice changes no log-prob)."""
    have = [s.routed_experts is not None for s in group.samples]
    if not any(have):
        return {}
    if not all(have):
        raise ValueError(
            f"request {group.samples[have.index(False)].request_id!r} has no routed experts, "
            "other samples of its group have"
        )
    lp = len(group.samples[0].prompt_ids)
    routes = [torch.from_numpy(s.routed_experts.indices) for s in group.samples]
    return {"prompt_routes": routes[0][:lp], "response_routes": tuple(torch.cat([r[lp:], r[-1:]]) for r in routes)}


def unshare_prompts(mb: MicroBatch) -> MicroBatch:
    """``mb`` in the K-copies layout: every response packed after its own copy of the prompt
    (no shared-prompt attention). Response order, and so every per-token field, is unchanged;
    only ``packed`` grows (a baseline for ``attention.shared_prompt: false``)."""
    singles = [_group_part(g, [k]) for g in mb.groups for k in range(len(g.samples))]
    return replace(mb, packed=concat_groups([pack_group(to_token_group(g)) for g in singles]))


def make_micro_batch(
    groups: Sequence[ScoredGroup], *, policy_version: int, mini_batch: int = 0, replica: int = 0
) -> MicroBatch:
    """Pack kept groups (in the given order) into one ``MicroBatch``; no token budget check here."""
    if not groups:
        raise ValueError("make_micro_batch needs at least one group")
    if any(not g.kept for g in groups):
        raise ValueError("make_micro_batch got a group dropped by dynamic sampling")
    steps = {g.step for g in groups}
    if len(steps) != 1:
        raise ValueError(f"a micro-batch mixes steps {sorted(steps)}")
    samples = [s for g in groups for s in g.samples]
    if late := [s.request_id for s in samples if s.versions_per_token[-1] > policy_version]:
        raise ValueError(f"request {late[0]!r} has tokens newer than the policy version {policy_version} training it")
    return MicroBatch(
        step=groups[0].step,
        policy_version=policy_version,
        mini_batch=mini_batch,
        groups=tuple(groups),
        packed=concat_groups([pack_group(to_token_group(g)) for g in groups]),
        advantages=torch.cat([g.advantages.to(torch.float32) for g in groups]),
        behav_logprobs=torch.tensor([lp for s in samples for lp in s.behav_logprobs], dtype=torch.float32),
        versions=torch.tensor([s.weight_version for s in samples], dtype=torch.int64),
        replica=replica,
        loss_mask=_loss_mask(samples),
        teacher_logprobs=_teacher_logprobs(samples),
        per_token_versions=torch.tensor([v for s in samples for v in s.versions_per_token], dtype=torch.int64),
    )


def _teacher_logprobs(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[N]`` float32 teacher log-probs of the samples' response tokens, or None if no sample has
    them; ``ValueError`` when only some have (a group the teacher stage did not score)."""
    have = [s.teacher_logprobs is not None for s in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"request {samples[have.index(False)].request_id!r} has no teacher log-probs, others have")
    return torch.tensor([lp for s in samples for lp in s.teacher_logprobs], dtype=torch.float32)


def _loss_mask(samples: Sequence[Sample]) -> torch.Tensor | None:
    """``[N]`` bool over the samples' response tokens, or None if no sample has a mask."""
    if all(s.loss_mask is None for s in samples):
        return None
    masks = [s.loss_mask if s.loss_mask is not None else (1,) * len(s.response_ids) for s in samples]
    return torch.tensor([m for mask in masks for m in mask], dtype=torch.bool)


def split_group(group: ScoredGroup, token_budget: int) -> list[ScoredGroup]:
    """``[group]`` if it fits ``token_budget``, else consecutive parts ``[prompt, r_i..r_j]`` that
    each fit (greedy, sample order kept). Each part keeps the group's prompt, step, index and
    the per-sample rewards / advantages of its samples: every loss term is per token or per
    sequence with a batch-level denominator, so training the parts equals training the whole.
    ``ValueError`` if the prompt and one response alone exceed the budget."""
    if group.num_packed_tokens <= token_budget:
        return [group]
    prompt = len(group.samples[0].prompt_ids)
    lengths = [len(s.response_ids) for s in group.samples]
    for k, n in enumerate(lengths):
        if prompt + n > token_budget:
            raise ValueError(
                f"group {group.prompt_id!r} (step {group.step}): prompt ({prompt} tokens) + response {k} "
                f"({n} tokens) exceed micro_batch_tokens={token_budget}; raise pipeline.micro_batch_tokens to at "
                "least data.max_prompt_tokens + rollout.sampling.max_new_tokens"
            )
    # Every part repeats the prompt: the responses share what the budget leaves beside it.
    parts = greedy_chunks(lengths, token_budget - prompt, name=lambda k: f"response {k}")
    return [_group_part(group, idx) for idx in parts]


def _group_part(group: ScoredGroup, indices: list[int]) -> ScoredGroup:
    pick = torch.tensor(indices, dtype=torch.int64)
    return ScoredGroup(
        step=group.step,
        prompt_index=group.prompt_index,
        prompt_id=group.prompt_id,
        samples=tuple(group.samples[k] for k in indices),
        rewards=group.rewards[pick],
        advantages=group.advantages[pick],
        kept=group.kept,
    )


def chunk_by_tokens(groups: Sequence[ScoredGroup], token_budget: int) -> list[list[ScoredGroup]]:
    """Greedy, order-preserving split into chunks of at most ``token_budget`` packed tokens;
    groups over the budget are split first (``split_group``)."""
    parts = [part for g in groups for part in split_group(g, token_budget)]
    chunks = greedy_chunks(
        [g.num_packed_tokens for g in parts],
        token_budget,
        name=lambda i: f"group {parts[i].prompt_id!r} (step {parts[i].step})",
    )
    return [[parts[i] for i in chunk] for chunk in chunks]
