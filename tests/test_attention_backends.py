"""Shared-prompt attention backends runnable in-process on the CPU (reference, split) against
the independent K-copies oracle: outputs and gradients wrt q, k, v; plus dispatch errors."""

import math

import pytest
import torch

from megatron_rl.attention import AttentionLayout, resolve_backend, shared_prompt_attention
from tests.attention_cases import CASES, Case, k_copies_oracle, make_inputs, max_rel_err


def _run(case: Case, backend: str, seed: int = 0):
    x = make_inputs(case, seed)
    scale = 1.0 / math.sqrt(case.d)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    q, k, v = (t.clone().requires_grad_() for t in (x.q, x.k, x.v))
    out = shared_prompt_attention(q, k, v, layout, backend=backend)
    (out * x.w).sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad), k_copies_oracle(case, x, scale)


@pytest.mark.parametrize("backend", ["reference", "split"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_backend_matches_k_copies(case: Case, backend: str) -> None:
    out, (dq, dk, dv), ref = _run(case, backend)
    torch.testing.assert_close(out, ref.out, atol=1e-5, rtol=1e-5)
    for rows, copy_out in ref.prompt_copies:  # every copy saw the same prompt
        torch.testing.assert_close(out[rows], copy_out, atol=1e-5, rtol=1e-5)
    for name, got, want in (("dq", dq, ref.dq), ("dk", dk, ref.dk), ("dv", dv, ref.dv)):
        assert max_rel_err(got, want) <= 1e-4, name


def test_split_is_not_the_plain_causal_mask() -> None:
    """Guards the oracle: responses must not see each other, so plain causal attention differs."""
    case = CASES[0]
    x = make_inputs(case)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    out = shared_prompt_attention(x.q, x.k, x.v, layout, backend="split")
    causal = torch.nn.functional.scaled_dot_product_attention(
        x.q.transpose(0, 1), x.k.transpose(0, 1), x.v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    lp, r1 = case.prompt_lens[0], case.response_lens[0][0]
    torch.testing.assert_close(out[: lp + r1], causal[: lp + r1])  # prompt and r_1 agree
    assert (out[lp + r1 :] - causal[lp + r1 :]).abs().max() > 1e-2  # later responses do not


def test_split_plan_is_built_once_per_layout() -> None:
    case = CASES[3]
    x = make_inputs(case)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    shared_prompt_attention(x.q, x.k, x.v, layout, backend="split")
    plan = layout.cached_plan(("split", x.q.device), lambda: None)
    shared_prompt_attention(x.q, x.k, x.v, layout, backend="split")
    assert plan is not None and layout.cached_plan(("split", x.q.device), lambda: None) is plan


def test_custom_softmax_scale() -> None:
    case = CASES[0]
    x = make_inputs(case)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    out = shared_prompt_attention(x.q, x.k, x.v, layout, backend="split", softmax_scale=0.3)
    ref = k_copies_oracle(case, x, 0.3)
    torch.testing.assert_close(out, ref.out, atol=1e-5, rtol=1e-5)


def test_resolve_backend_auto_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("auto", "cpu", requires_grad=True) == "split"
    assert resolve_backend("auto", "npu", requires_grad=True) == "npu"
    assert resolve_backend("auto", "cuda", requires_grad=True) in ("triton", "flex")
    assert resolve_backend("flex", "cpu", requires_grad=False) == "flex"
    with pytest.raises(ValueError, match="'bogus'"):
        resolve_backend("bogus", "cpu", requires_grad=False)
    with pytest.raises(ValueError, match="forward-only"):
        resolve_backend("flex", "cpu", requires_grad=True)
    with pytest.raises(ValueError, match="torch_npu"):
        resolve_backend("npu", "cpu", requires_grad=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_backend("triton", "cpu", requires_grad=False)


def test_dispatch_refuses_flex_with_grad_on_cpu_before_running() -> None:
    case = CASES[1]
    x = make_inputs(case)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    with pytest.raises(ValueError, match="forward-only"):
        shared_prompt_attention(x.q.requires_grad_(), x.k, x.v, layout, backend="flex")


def test_shape_errors() -> None:
    layout = AttentionLayout.from_lengths([3], [[2]])
    q, kv = torch.randn(5, 3, 16), torch.randn(5, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        shared_prompt_attention(q, kv, kv, layout, backend="split")
    with pytest.raises(ValueError, match="tokens"):
        shared_prompt_attention(q[:4], kv[:4], kv[:4], layout, backend="split")
    with pytest.raises(ValueError, match="prompt_lens"):
        AttentionLayout.from_lengths([0], [[2]])
