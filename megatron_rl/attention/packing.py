"""Packing groups of responses into shared-prompt micro-batches, and unpacking the results.

A ``TokenGroup`` (one prompt, K responses) becomes ``[prompt, r_1, ..., r_K]`` once
(``pack_group``). Several packed groups are concatenated into a ``PackedMicroBatch`` under a
token budget (``pack_groups``), THD style: no padding between groups.

Conventions (the contract with the model and the loss):
- ``position_ids``: 0..Lp-1 on the prompt; every response restarts at Lp.
- ``segment_ids``: group-local, 0 = prompt, i = response i (1-based); ``group_ids`` tells
  the groups of a micro-batch apart (0-based, in packing order).
- Log-prob index map: response tokens of the whole micro-batch are enumerated group by
  group, response by response (N tokens in all). ``logit_index[n]`` is the packed position
  whose logits predict token n, ``target_ids[n]`` that token. The first token of every
  response of a group is predicted from the prompt's last position (shared by all K).
  Per-token log-probs are ``log_softmax(logits[logit_index]).gather(target_ids)``: shape
  ``[N]``; ``unpack_logprobs`` splits such an ``[N]`` tensor back per response.
- ``pack_groups`` keeps the input order and fills micro-batches greedily. A group longer
  than the budget raises ``ValueError`` (a budget must fit the longest group allowed by the
  config: max prompt length + G x max response length), so memory per micro-batch is bounded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from megatron_rl.attention.layout import AttentionLayout


@dataclass(frozen=True, kw_only=True)
class TokenGroup:
    """One prompt and its K responses, as 1-D int64 token-id tensors."""

    prompt_ids: torch.Tensor  # [Lp]
    response_ids: tuple[torch.Tensor, ...]  # K tensors of [Lr_i]
    # MoE routing replay: the engine's experts per token, [Lp, L, top_k] and K x [Lr_i, L, top_k]
    prompt_routes: torch.Tensor | None = None
    response_routes: tuple[torch.Tensor, ...] | None = None

    @property
    def num_packed_tokens(self) -> int:
        return self.prompt_ids.numel() + sum(r.numel() for r in self.response_ids)


@dataclass(frozen=True, kw_only=True)
class PackedGroup:
    """One group packed as ``[prompt, r_1, ..., r_K]``; index fields are group-local."""

    token_ids: torch.Tensor  # [Tg]
    position_ids: torch.Tensor  # [Tg]
    segment_ids: torch.Tensor  # [Tg] 0 = prompt, i = response i
    logit_index: torch.Tensor  # [Ng] group-local packed position predicting each response token
    target_ids: torch.Tensor  # [Ng]
    prompt_len: int
    response_lens: tuple[int, ...]
    routed_experts: torch.Tensor | None = None  # [Tg, L, top_k] int16, MoE routes of every packed token


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch:
    """Several packed groups back to back (see the module doc for each field's convention)."""

    token_ids: torch.Tensor  # [T] int64
    position_ids: torch.Tensor  # [T] int64
    segment_ids: torch.Tensor  # [T] int64, group-local
    group_ids: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [n_segments + 1] int32, every prompt and response a segment
    logit_index: torch.Tensor  # [N] int64 into [0, T)
    target_ids: torch.Tensor  # [N] int64
    response_lens: tuple[int, ...]  # [R], R = responses of all groups, in order
    layout: AttentionLayout  # the layout_meta of ``shared_prompt_attention``
    routed_experts: torch.Tensor | None = None  # [T, L, top_k] int16: the engine's MoE routes (routing replay)

    @property
    def num_tokens(self) -> int:
        return self.token_ids.numel()

    @property
    def num_responses(self) -> int:
        return len(self.response_lens)

    def to(self, device: torch.device) -> PackedMicroBatch:
        """The tensors on ``device`` (one copy each, non-blocking); ``layout`` stays a host
        description whose device plans the attention backends build and cache."""
        if self.token_ids.device == torch.device(device):
            return self
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in _TENSOR_FIELDS}
        if self.routed_experts is not None:
            moved["routed_experts"] = self.routed_experts.to(device, non_blocking=True)
        return replace(self, **moved)


_TENSOR_FIELDS = ("token_ids", "position_ids", "segment_ids", "group_ids", "cu_seqlens", "logit_index", "target_ids")


def _as_ids(x: torch.Tensor | Sequence[int], what: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.int64)
    if t.dim() != 1 or t.numel() == 0:
        raise ValueError(f"{what} must be a non-empty 1-D sequence of token ids, got shape {tuple(t.shape)}")
    return t


def pack_group(group: TokenGroup) -> PackedGroup:
    """Pack one group as ``[prompt, r_1, ..., r_K]`` with positions, segments and the index map."""
    prompt = _as_ids(group.prompt_ids, "prompt_ids")
    responses = [_as_ids(r, f"response_ids[{i}]") for i, r in enumerate(group.response_ids)]
    lp = prompt.numel()
    tokens, positions, segments, logit_index = [prompt], [torch.arange(lp)], [torch.zeros(lp, dtype=torch.int64)], []
    start = lp
    for i, resp in enumerate(responses, start=1):
        lr = resp.numel()
        tokens.append(resp)
        positions.append(torch.arange(lp, lp + lr))
        segments.append(torch.full((lr,), i, dtype=torch.int64))
        # token 0 is predicted at the prompt's last position, token j>0 at the response's j-1.
        logit_index.append(torch.cat([torch.tensor([lp - 1]), torch.arange(start, start + lr - 1)]))
        start += lr
    empty = torch.zeros(0, dtype=torch.int64)
    return PackedGroup(
        token_ids=torch.cat(tokens),
        position_ids=torch.cat(positions),
        segment_ids=torch.cat(segments),
        logit_index=torch.cat(logit_index) if logit_index else empty,
        target_ids=torch.cat(responses) if responses else empty,
        prompt_len=lp,
        response_lens=tuple(r.numel() for r in responses),
        routed_experts=_group_routes(group),
    )


def _group_routes(group: TokenGroup) -> torch.Tensor | None:
    """``[Tg, L, top_k]``: the group's routes in packed order, or None without routes."""
    if group.prompt_routes is None:
        return None
    routes = torch.cat([group.prompt_routes, *group.response_routes])
    if routes.shape[0] != group.num_packed_tokens:
        raise ValueError(f"routes for {routes.shape[0]} tokens, the group packs {group.num_packed_tokens}")
    return routes


def _concat_routes(packed: Sequence[PackedGroup]) -> torch.Tensor | None:
    routes = [g.routed_experts for g in packed]
    if all(r is None for r in routes):
        return None
    if any(r is None for r in routes):
        raise ValueError("a micro-batch mixes groups with and without routed experts")
    return torch.cat(routes)


def concat_groups(packed: Sequence[PackedGroup]) -> PackedMicroBatch:
    """Concatenate packed groups into one micro-batch (no padding), offsetting the index map."""
    if not packed:
        raise ValueError("concat_groups needs at least one packed group")
    offsets, total = [], 0
    for g in packed:
        offsets.append(total)
        total += g.token_ids.numel()
    layout = AttentionLayout.from_lengths([g.prompt_len for g in packed], [g.response_lens for g in packed])
    return PackedMicroBatch(
        token_ids=torch.cat([g.token_ids for g in packed]),
        position_ids=torch.cat([g.position_ids for g in packed]),
        segment_ids=torch.cat([g.segment_ids for g in packed]),
        group_ids=torch.cat([torch.full_like(g.token_ids, i) for i, g in enumerate(packed)]),
        cu_seqlens=layout.cu_seqlens,
        logit_index=torch.cat([g.logit_index + off for g, off in zip(packed, offsets, strict=True)]),
        target_ids=torch.cat([g.target_ids for g in packed]),
        response_lens=tuple(n for g in packed for n in g.response_lens),
        layout=layout,
        routed_experts=_concat_routes(packed),
    )


def greedy_chunks(sizes: Sequence[int], token_budget: int, *, name: Callable[[int], str]) -> list[list[int]]:
    """Indices of ``sizes`` split greedily, in order, into chunks of at most ``token_budget``
    tokens. ``ValueError`` (naming the item with ``name(i)``) for an item over the budget."""
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    chunks: list[list[int]] = []
    used = token_budget + 1  # forces a new chunk for the first item
    for i, n in enumerate(sizes):
        if n > token_budget:
            raise ValueError(
                f"{name(i)} packs to {n} tokens, more than the micro-batch token budget {token_budget}; raise "
                "it to at least max_prompt_len + group_size * max_response_len"
            )
        if used + n > token_budget:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += n
    return chunks


def pack_groups(groups: Sequence[TokenGroup], token_budget: int) -> list[PackedMicroBatch]:
    """Greedy, order-preserving packing: a micro-batch takes groups while their packed token
    count stays <= ``token_budget``. Raises ``ValueError`` for a group longer than the budget."""
    chunks = greedy_chunks([g.num_packed_tokens for g in groups], token_budget, name=lambda i: f"group {i}")
    return [concat_groups([pack_group(groups[i]) for i in chunk]) for chunk in chunks]


def k_copies(groups: Sequence[TokenGroup]) -> list[TokenGroup]:
    """The K-copies layout: each response as its own group ``[prompt, r_i]`` (plain causal).

    Packing the result gives the same response order, so ``unpack_logprobs`` of both layouts
    lines up response by response; used for equivalence tests and benchmarks."""
    return [
        TokenGroup(
            prompt_ids=g.prompt_ids,
            response_ids=(r,),
            prompt_routes=g.prompt_routes,
            response_routes=None if g.response_routes is None else (g.response_routes[i],),
        )
        for g in groups
        for i, r in enumerate(g.response_ids)
    ]


def unpack_logprobs(per_token: torch.Tensor, mb: PackedMicroBatch) -> list[torch.Tensor]:
    """Split ``per_token [N, ...]`` (aligned with ``mb.logit_index``) into R tensors ``[Lr_i, ...]``."""
    if per_token.shape[0] != mb.logit_index.numel():
        raise ValueError(
            f"per_token has {per_token.shape[0]} rows, the micro-batch has {mb.logit_index.numel()} response tokens"
        )
    return list(torch.split(per_token, list(mb.response_lens)))


def unpack_logprobs_padded(
    per_token: torch.Tensor, mb: PackedMicroBatch, pad_value: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_token [N]`` -> (``[R, max_len]`` padded with ``pad_value``, ``[R, max_len]`` bool
    mask), both on ``per_token``'s device."""
    padded = pad_responses(per_token, mb, pad_value)
    return padded, response_mask(mb, padded.shape[1], per_token.device)


def pad_responses(per_token: torch.Tensor, mb: PackedMicroBatch, pad_value: float = 0.0) -> torch.Tensor:
    """``per_token [N]`` -> ``[R, max_len]``, each response's row padded with ``pad_value``."""
    return torch.nn.utils.rnn.pad_sequence(unpack_logprobs(per_token, mb), batch_first=True, padding_value=pad_value)


def response_mask(mb: PackedMicroBatch, max_len: int, device: torch.device) -> torch.Tensor:
    """``[R, max_len]`` bool, True on each response's tokens; built on ``device`` from the
    lengths (one small host -> device copy)."""
    lens = torch.tensor(mb.response_lens, dtype=torch.int64).to(device, non_blocking=True)
    return torch.arange(max_len, device=device)[None, :] < lens[:, None]
