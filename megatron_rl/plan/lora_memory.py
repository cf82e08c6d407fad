"""The LoRA terms of the plan's memory model (`plan/memory.py`), for ``lora.rank`` > 0.

With LoRA (`megatron_rl.lora.apply_lora`) one rank holds the frozen base once, in model.dtype,
with no gradient buffer, no optimizer state and no fp32 master; the reference is that base
with the adapters off (no copy) and the old policy a snapshot of the adapters only. Adapters
(rank r) sit on the targeted linears of every decoder layer, one per HF projection, sharded as
``lora/adapter.py`` shards them (TP size t, hidden h, FFN f, nq / nkv heads of d):

    linear_qkv   column   3 parts (q, k, v): A [r, h] replicated, B [out / t, r]: 3·r·h + r·(nq + 2·nkv)·d / t
    linear_fc1   column   2 parts (gate, up):                                    2·r·h + 2·r·f / t
    linear_proj  row      A [r, nq·d / t], B [h, r] replicated:                  r·nq·d / t + r·h
    linear_fc2   row      A [r, f / t], B [h, r] replicated:                     r·f / t + r·h

A MoE layer adapts its shared expert's fc1 / fc2 (f = the shared FFN), never the routed experts.
Adapters are model.dtype parameters trained like the full model's: fp32 gradients, Adam moments
and (bf16) an fp32 master each.

Activations: each adapter part saves its low-rank activation A x (T·r·b) and, with dropout, its
own dropped input and mask (T·in·(b + 1), in as A holds it), on top of the full fine-tune count.
What a frozen base no longer saves (megatron's ``LinearWithFrozenWeight`` keeps no input, frozen
norm weights need no normalised input) is not taken off: the estimate errs high, never low.
"""

from __future__ import annotations

from dataclasses import dataclass

COLUMN = ("linear_qkv", "linear_fc1")


@dataclass(frozen=True, kw_only=True)
class LoraMemory:
    """The LoRA choices the memory model needs: rank, targeted linears, dropout on/off, and
    how many adapter copies a rank holds (the policy's, plus the old policy's snapshot)."""

    rank: int
    targets: tuple[str, ...]
    dropout: bool = False
    snapshots: int = 1  # adapter copies: policy (+ old) - the reference has none


@dataclass(frozen=True)
class _Linear:
    """One targeted linear on one TP rank: its parts' (local A input width, local B rows)."""

    parts: tuple[tuple[int, int], ...]


def _linears(name: str, *, hidden: int, attn: int, kv: int, ffn: int, tp: int) -> _Linear:
    """Local A widths and B rows of `name`'s parts (attn = nq·d, kv = nkv·d, ffn: this MLP's)."""
    if name == "linear_qkv":
        return _Linear(((hidden, attn // tp), (hidden, kv // tp), (hidden, kv // tp)))
    if name == "linear_fc1":
        return _Linear(((hidden, ffn // tp), (hidden, ffn // tp)))
    if name == "linear_proj":
        return _Linear(((attn // tp, hidden),))
    if name == "linear_fc2":
        return _Linear(((ffn // tp, hidden),))
    raise ValueError(f"lora.target_modules: unknown linear {name!r}")


def _layer_linears(dims, lora: LoraMemory, tp: int, ffn: int) -> list[tuple[str, _Linear]]:
    """The targeted linears of one layer whose MLP has width `ffn` (0: no adaptable MLP)."""
    attn, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    names = [n for n in lora.targets if ffn or n not in ("linear_fc1", "linear_fc2")]
    return [(n, _linears(n, hidden=dims.hidden, attn=attn, kv=kv, ffn=ffn, tp=tp)) for n in names]


def layer_adapter_params(dims, lora: LoraMemory, tp: int, ffn: int) -> int:
    """Adapter parameters of one decoder layer on one TP rank (module docstring)."""
    r = lora.rank
    return sum(r * a_in + r * b_out for _, lin in _layer_linears(dims, lora, tp, ffn) for a_in, b_out in lin.parts)


def layer_activation_bytes(dims, lora: LoraMemory, tp: int, ffn: int, *, tokens: int, b: int) -> int:
    """Saved bytes the adapters add to one layer's full fine-tune count (module docstring)."""
    return sum(
        tokens * lora.rank * b + (tokens * a_in * (b + 1) if lora.dropout else 0)
        for _, lin in _layer_linears(dims, lora, tp, ffn)
        for a_in, _ in lin.parts
    )
