"""Block-sparse flash attention (forward + backward) for the shared-prompt mask, in Triton.

Inputs are THD-packed: q ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]`` (GQA: query head h reads
key/value head ``h // (Hq // Hkv)``, as ``repeat_interleave`` would). Query row i sits at packed
position ``t = q_pos[i]`` and may see the keys ``[group_start[i], prefix_end[i]) ∪
[seg_start[i], t]`` (see ``megatron_rl.attention.layout``). Single rank: ``q_pos = arange(T)``,
``T_q = T_k = T``; under context parallelism the rows are a CP rank's tokens and the keys the
whole gathered packed sequence (dK / dV then cover all ``T_k`` keys, from this rank's queries).
No K/V is copied: every query block loops over the key blocks its rows can see (``BlockPlan``,
``triton_block_plan``, built on the host once per micro-batch), and masks inside a block
element-wise, so fully masked blocks (other groups, other responses) are never touched.
Backward is FlashAttention-2 style: ``dq`` per query block, ``dk``/``dv`` per key block (per
query head, then summed over the heads sharing a K/V head).

Under ``TRITON_INTERPRET=1`` (CPU tests) bf16/fp16 inputs are upcast to fp32 before
``tl.dot``, whose low-precision path is wrong in the interpreter. fp32 dots use IEEE
precision (no TF32) so fp32 results match a reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .triton_block_plan import BlockPlan, build_block_plan

__all__ = ["BlockPlan", "build_block_plan", "shared_prompt_flash_attention"]


@triton.jit
def _row_masks(QPOS, GS, PE, SS, offs_m, T_Q):
    """Query rows ``offs_m``: (in range, packed position, group start, prefix end, segment start)."""
    ok = offs_m < T_Q
    pos = tl.load(QPOS + offs_m, mask=ok, other=0)
    gs = tl.load(GS + offs_m, mask=ok, other=0)
    pe = tl.load(PE + offs_m, mask=ok, other=0)
    return ok, pos, gs, pe, tl.load(SS + offs_m, mask=ok, other=0)


@triton.jit
def _allowed(row_ok, pos, offs_n, gs, pe, ss, T_K):
    n = offs_n[None, :]
    prefix = (n >= gs[:, None]) & (n < pe[:, None])
    own = (n >= ss[:, None]) & (n <= pos[:, None])
    return (prefix | own) & row_ok[:, None] & (n < T_K)


@triton.jit
def _load_rows(ptr, offs, head, stride_t, stride_h, T, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(
        ptr + offs.to(tl.int64)[:, None] * stride_t + head * stride_h + d[None, :], mask=(offs < T)[:, None], other=0.0
    )
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    GS,
    PE,
    SS,
    QPOS,
    KV_BLOCKS,
    KV_COUNT,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    T_Q,
    T_K,
    scale,
    H_RATIO,
    MAX_KV,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // H_RATIO
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_rows(Q, offs_m, h, stride_qt, stride_qh, T_Q, HEAD_DIM, UPCAST)
    row_ok, pos, gs, pe, ss = _row_masks(QPOS, GS, PE, SS, offs_m, T_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j in range(tl.load(KV_COUNT + qb)):
        offs_n = tl.load(KV_BLOCKS + qb * MAX_KV + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_rows(K, offs_n, kvh, stride_kt, stride_kh, T_K, HEAD_DIM, UPCAST)
        v = _load_rows(V, offs_n, kvh, stride_kt, stride_kh, T_K, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(_allowed(row_ok, pos, offs_n, gs, pe, ss, T_K), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    d = tl.arange(0, HEAD_DIM)
    tl.store(
        Out + offs_m.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
        (acc / l_safe[:, None]).to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(LSE + h * T_Q + offs_m, m_i + tl.log(l_safe), mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    DQ,
    LSE,
    DELTA,
    GS,
    PE,
    SS,
    QPOS,
    KV_BLOCKS,
    KV_COUNT,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    T_Q,
    T_K,
    scale,
    H_RATIO,
    MAX_KV,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    qb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // H_RATIO
    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, pos, gs, pe, ss = _row_masks(QPOS, GS, PE, SS, offs_m, T_Q)
    q = _load_rows(Q, offs_m, h, stride_qt, stride_qh, T_Q, HEAD_DIM, UPCAST)
    do = _load_rows(DO, offs_m, h, stride_qt, stride_qh, T_Q, HEAD_DIM, UPCAST)
    lse = tl.load(LSE + h * T_Q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + h * T_Q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j in range(tl.load(KV_COUNT + qb)):
        offs_n = tl.load(KV_BLOCKS + qb * MAX_KV + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = _load_rows(K, offs_n, kvh, stride_kt, stride_kh, T_K, HEAD_DIM, UPCAST)
        v = _load_rows(V, offs_n, kvh, stride_kt, stride_kh, T_K, HEAD_DIM, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.where(_allowed(row_ok, pos, offs_n, gs, pe, ss, T_K), tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    d = tl.arange(0, HEAD_DIM)
    tl.store(
        DQ + offs_m.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
        (dq * scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    LSE,
    DELTA,
    GS,
    PE,
    SS,
    QPOS,
    Q_BLOCKS,
    Q_COUNT,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    T_Q,
    T_K,
    scale,
    H_RATIO,
    MAX_Q,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    kb = tl.program_id(0)
    h = tl.program_id(1)  # query head; DK/DV are per query head [T, Hq, D], strided like Q
    kvh = h // H_RATIO
    offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_rows(K, offs_n, kvh, stride_kt, stride_kh, T_K, HEAD_DIM, UPCAST)
    v = _load_rows(V, offs_n, kvh, stride_kt, stride_kh, T_K, HEAD_DIM, UPCAST)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for j in range(tl.load(Q_COUNT + kb)):
        offs_m = tl.load(Q_BLOCKS + kb * MAX_Q + j) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok, pos, gs, pe, ss = _row_masks(QPOS, GS, PE, SS, offs_m, T_Q)
        q = _load_rows(Q, offs_m, h, stride_qt, stride_qh, T_Q, HEAD_DIM, UPCAST)
        do = _load_rows(DO, offs_m, h, stride_qt, stride_qh, T_Q, HEAD_DIM, UPCAST)
        lse = tl.load(LSE + h * T_Q + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + h * T_Q + offs_m, mask=row_ok, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        p = tl.where(_allowed(row_ok, pos, offs_n, gs, pe, ss, T_K), tl.exp(s - lse[:, None]), 0.0)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    d = tl.arange(0, HEAD_DIM)
    out = offs_n.to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :]
    col_ok = (offs_n < T_K)[:, None]
    tl.store(DK + out, (dk * scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=col_ok)


def _launch_options(dtype: torch.dtype) -> dict[str, object]:
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return {"UPCAST": interpret and dtype != torch.float32, "PRECISION": "ieee" if dtype == torch.float32 else None}


def _check_plan(plan: BlockPlan, t_q: int, t_k: int) -> None:
    if plan.q_pos.numel() != t_q or plan.num_keys != t_k:
        raise ValueError(
            f"the block plan is for {plan.q_pos.numel()} queries x {plan.num_keys} keys, got {t_q} x {t_k}"
        )


class _SharedPromptFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: BlockPlan, scale: float):  # type: ignore[override]
        t, hq, d = q.shape
        ratio = hq // k.shape[1]
        _check_plan(plan, t, k.shape[0])
        out = torch.empty_like(q)
        lse = torch.empty(hq, t, device=q.device, dtype=torch.float32)
        grid = (plan.kv_count.numel(), hq)
        _fwd_kernel[grid](
            q,
            k,
            v,
            out,
            lse,
            plan.group_start,
            plan.prefix_end,
            plan.seg_start,
            plan.q_pos,
            plan.kv_blocks,
            plan.kv_count,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            t,
            plan.num_keys,
            scale,
            ratio,
            plan.kv_blocks.shape[1],
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            HEAD_DIM=d,
            **_launch_options(q.dtype),
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan: BlockPlan = ctx.plan
        dout = dout.contiguous()
        t, hq, d = q.shape
        t_k, hkv = k.shape[:2]
        delta = (out.float() * dout.float()).sum(-1).T.contiguous()  # [Hq, T]
        dq = torch.empty_like(q)
        dk_h = torch.empty(t_k, hq, d, device=q.device, dtype=torch.float32)  # per query head
        dv_h = torch.empty_like(dk_h)
        common = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, HEAD_DIM=d, **_launch_options(q.dtype))
        masks = (plan.group_start, plan.prefix_end, plan.seg_start, plan.q_pos)
        strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), t, t_k, ctx.scale, hq // hkv)
        _bwd_dq_kernel[(plan.kv_count.numel(), hq)](
            q,
            k,
            v,
            dout,
            dq,
            lse,
            delta,
            *masks,
            plan.kv_blocks,
            plan.kv_count,
            *strides,
            plan.kv_blocks.shape[1],
            **common,
        )
        _bwd_dkdv_kernel[(plan.q_count.numel(), hq)](
            q,
            k,
            v,
            dout,
            dk_h,
            dv_h,
            lse,
            delta,
            *masks,
            plan.q_blocks,
            plan.q_count,
            *strides,
            plan.q_blocks.shape[1],
            **common,
        )
        dk = dk_h.view(t_k, hkv, hq // hkv, d).sum(2).to(k.dtype)
        dv = dv_h.view(t_k, hkv, hq // hkv, d).sum(2).to(v.dtype)
        return dq, dk, dv, None, None


def shared_prompt_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, softmax_scale: float
) -> torch.Tensor:
    """q ``[T_q, Hq, D]``, k/v ``[T_k, Hkv, D]`` -> ``[T_q, Hq, D]`` under ``plan``
    (``build_block_plan``); D a power of two >= 16."""
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"the triton kernel needs a head dim that is a power of two >= 16, got {d}")
    return _SharedPromptFlash.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, softmax_scale)
