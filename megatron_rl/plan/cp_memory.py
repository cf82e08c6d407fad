"""The attention core's saved bytes, and what context parallelism changes (`plan/memory.py`).

With ``parallel.cp`` = c > 1 every packed micro-batch of T tokens is split over c ranks
(`attention/cp_split.py`: every prompt and response is cut into 2c chunks, rank r holds chunks r
and 2c - 1 - r of each; the ±1 token per chunk is ignored here), so a rank holds T_c = ⌈T / c⌉
tokens: every per-token term of a layer (norms, RoPE, QKV and out
projections, MLP), the token ids, the final norm and the activation sent down the pipeline scale
by 1 / c. The attention core is the exception: each layer all-gathers the K and V of the whole
packed sequence across the CP group (Llama 3's all-gather CP; the prompt's K / V are held once
per group, so every response token on every rank sees its group's prompt), and each rank's
T_c query rows attend to them. Per layer and rank, with b bytes of model.dtype, t = parallel.tp:

    K / V all-gather buffer   2·T·(kv_heads/t)·head_dim·b     saved for the backward (recompute
                              none; ``split`` keeps per-run copies instead, see
                              `_cp_core_bytes`), rebuilt with the layer or the core (full /
                              selective)
    backward                  the same 2·T·(kv_heads/t)·head_dim·b for dK / dV of the whole
                              sequence before their reduce-scatter: a transient of one layer
    communication             all-gather of (c - 1)/c of the buffer forward, reduce-scatter of
                              the same bytes backward

Log-prob rows on a rank: at most its T_c tokens (and at most N). Adam state with the
distributed optimizer is sharded over DP × CP (megatron-core's ``dp_cp`` group); the routed
experts' over DP × CP / EP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # memory.py imports this module
    from megatron_rl.plan.memory import MemorySettings, ModelDims

FLASH_BACKENDS = ("npu", "triton", "flex")  # save q, k, v, out and the log-sum-exp only


def rank_tokens(tokens: int, cp: int) -> int:
    """Tokens one CP rank holds of a `tokens`-token micro-batch."""
    return -(-tokens // cp)


def kv_gather_bytes(dims: ModelDims, s: MemorySettings) -> int:
    """One layer's all-gathered K and V of the whole packed sequence on one rank (0 at cp 1)."""
    if s.cp == 1:
        return 0
    return 2 * s.micro_batch.tokens * (dims.kv_heads // s.tp) * dims.head_dim * s.dtype_bytes


def attention_core_bytes(dims: ModelDims, s: MemorySettings) -> int:
    """Saved bytes of one layer's shared-prompt attention core on one TP (and CP) rank.

    flash-style backends (npu / triton / flex): q, k, v, out (model dtype) and an fp32 LSE
    row per head. ``split`` (CPU): per group part, one causal call over [prompt; longest
    response] plus one batched call for the other K - 1 responses, whose keys are the
    prompt's K/V gathered per response (and a dense [Lr, Lp + Lr] mask). ``reference``: the
    dense path, plus [heads, T, T] scores and probabilities. Under CP (`_cp_core_bytes`) the
    query side holds the rank's T / cp rows and the keys are the all-gathered sequence.
    """
    if s.cp > 1:
        return _cp_core_bytes(dims, s)
    b, t, d, mb = s.dtype_bytes, s.tp, dims.head_dim, s.micro_batch
    nq, nkv = dims.heads // t, dims.kv_heads // t

    def flash(tokens: int) -> int:
        return tokens * (2 * nq + 2 * nkv) * d * b + 4 * tokens * nq

    if s.attention_backend in FLASH_BACKENDS:
        return flash(mb.tokens)
    if s.attention_backend == "reference":
        return flash(mb.tokens) + 2 * nq * mb.tokens**2 * b
    lp, lr, k = mb.prompt_len, mb.response_len, mb.responses
    square = flash(lp + lr)
    others = (k - 1) * (lr * 2 * nq * d * b + (lp + lr) * 2 * nkv * d * b + lr * (lp + lr) * b + 4 * lr * nq)
    rest = max(0, mb.tokens - mb.parts * (lp + k * lr))  # budget not covered by the modelled parts
    return mb.parts * (square + others) + flash(rest)


def _cp_core_bytes(dims: ModelDims, s: MemorySettings) -> int:
    """The core under CP: q and out of the rank's rows and an LSE per row, and the keys: the
    all-gathered K / V (flash-style backends; ``reference`` adds [heads, T_c, T] scores and
    probabilities), or for ``split`` the copies its batched calls index out of them: each of the
    rank's 2 chunks of every response (and the prompt's later chunk) sees the prompt and its own
    segment up to the chunk, padded to the longest: 2K + 1 runs of Lp + Lr keys per part, each
    with a [lq = ⌈max(Lp, Lr) / 2c⌉, Lp + Lr] mask in model dtype (read off the saved tensors at
    cp 2: kb / vb [2K+1, Hkv, Lp+Lr, D] and the mask [2K+1, 1, lq, Lp+Lr] per layer; they do not
    shrink with cp, `tests/test_memory_plan_cp.py`)."""
    b, t, d, mb = s.dtype_bytes, s.tp, dims.head_dim, s.micro_batch
    nq, nkv = dims.heads // t, dims.kv_heads // t
    rows = rank_tokens(mb.tokens, s.cp)
    core = rows * 2 * nq * d * b + 4 * rows * nq
    if s.attention_backend == "split":  # 2K + 1 runs of Lp + Lr keys and their [lq, Lp + Lr] masks
        runs, keys = mb.parts * (2 * mb.responses + 1), mb.prompt_len + mb.response_len
        lq = -(-max(mb.prompt_len, mb.response_len) // (2 * s.cp))
        rest = max(0, mb.tokens - mb.parts * (mb.prompt_len + mb.responses * mb.response_len))
        return core + runs * keys * (2 * nkv * d + lq) * b + rest * 2 * nkv * d * b
    if s.attention_backend == "reference":
        return core + kv_gather_bytes(dims, s) + 2 * nq * rows * mb.tokens * b
    return core + kv_gather_bytes(dims, s)


def kv_gather_kept(dims: ModelDims, s: MemorySettings) -> int:
    """One layer's all-gathered K / V as the backward keeps it: the flash-style and reference
    calls save it whole; ``split`` saves its per-run copies instead (`_cp_core_bytes`)."""
    return 0 if s.attention_backend == "split" else kv_gather_bytes(dims, s)
