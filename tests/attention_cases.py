"""Shared-prompt attention test cases and the independent oracle they are checked against.

The oracle is the K-copies layout written out here, not taken from the code under test:
every response i of a group becomes its own sequence ``[prompt, r_i]`` with its own fresh
leaf tensors, run through plain causal SDPA (square, so ``is_causal`` is unambiguous).
The packed loss ``sum(out * w)`` corresponds to the K-copies loss in which each copy's
prompt rows carry ``w / K``: the packed gradient of a prompt row is the sum over copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Case:
    name: str
    prompt_lens: tuple[int, ...]
    response_lens: tuple[tuple[int, ...], ...]
    hq: int = 2
    hkv: int = 2
    d: int = 16

    @property
    def total(self) -> int:
        return sum(self.prompt_lens) + sum(sum(r) for r in self.response_lens)


CASES = (
    Case("ragged", (7,), ((3, 9, 1, 5),)),
    Case("k1", (6,), ((4,),)),
    Case("len1", (5,), ((1, 1, 1),)),
    Case("groups", (5, 12, 3), ((2, 6), (7,), (1, 4, 4))),
    Case("gqa", (9, 4), ((5, 2, 7), (3, 3)), hq=4, hkv=2),
    Case("mqa_with_plain_sequence", (6, 8), ((2, 5), ()), hq=4, hkv=1),
)


@dataclass(frozen=True)
class Inputs:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    w: torch.Tensor  # [T, Hq, D] loss weights: loss = sum(out * w)


def make_inputs(case: Case, seed: int = 0, dtype: torch.dtype = torch.float32) -> Inputs:
    g = torch.Generator().manual_seed(seed)

    def rnd(h: int) -> torch.Tensor:
        return torch.randn(case.total, h, case.d, generator=g).to(dtype)

    return Inputs(q=rnd(case.hq), k=rnd(case.hkv), v=rnd(case.hkv), w=rnd(case.hq))


@dataclass(frozen=True)
class OracleResult:
    out: torch.Tensor  # [T, Hq, D] (prompt rows from the first copy)
    prompt_copies: list[tuple[slice, torch.Tensor]]  # every copy's prompt output, to compare too
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale
    )
    return out.transpose(0, 1)


def k_copies_oracle(case: Case, x: Inputs, scale: float) -> OracleResult:
    """Outputs and grads of ``sum(out * w)`` via K separate causal sequences (see module doc)."""
    out = torch.zeros_like(x.q)
    dq, dk, dv = torch.zeros_like(x.q), torch.zeros_like(x.k), torch.zeros_like(x.v)
    prompt_copies = []
    start = 0
    for lp, lrs in zip(case.prompt_lens, case.response_lens, strict=True):
        p = slice(start, start + lp)
        r_start = start + lp
        copies = [slice(0, 0)] if not lrs else []
        for lr in lrs:
            copies.append(slice(r_start, r_start + lr))
            r_start += lr
        for r in copies:
            leaves = [torch.cat([t[p], t[r]]).detach().clone().requires_grad_() for t in (x.q, x.k, x.v)]
            o = _causal(*leaves, scale)
            w = torch.cat([x.w[p] / len(copies), x.w[r]])
            (o * w).sum().backward()
            n_r = r.stop - r.start
            out[r] = o[lp:].detach()
            prompt_copies.append((p, o[:lp].detach()))
            for acc, leaf in zip((dq, dk, dv), leaves, strict=True):
                acc[p] += leaf.grad[:lp]
                acc[r] += leaf.grad[lp : lp + n_r]
        out[p] = prompt_copies[-1][1]
        start = r_start
    return OracleResult(out=out, prompt_copies=prompt_copies, dq=dq, dk=dk, dv=dv)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (relative to the reference's scale)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
