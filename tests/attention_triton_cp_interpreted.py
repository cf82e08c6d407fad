"""The Triton shared-prompt kernel under context parallelism, under the CPU interpreter. Run only
by ``test_attention_triton.py`` in a subprocess with ``TRITON_INTERPRET=1``.

Subject: ``triton_backend.triton_rows_attention`` (a CP rank's rows as queries at their packed
positions ``q_pos``, against the whole K / V) and ``cp_attention(backend="triton")`` on gloo ranks.
References: the ``reference`` backend under CP (dense mask rows, plain SDPA) and the independent
K-copies oracle. dK / dV of one rank are its queries' share; summed over the ranks (what the
reduce-scatter does) they are the whole gradient.
"""

import functools
import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from megatron_rl_kernels.triton_shared_prompt import build_block_plan, shared_prompt_flash_attention  # noqa: E402

from megatron_rl.attention import AttentionLayout  # noqa: E402
from megatron_rl.attention.context_parallel import reference_rows_attention  # noqa: E402
from megatron_rl.attention.cp_split import build_cp_slice  # noqa: E402
from megatron_rl.attention.triton_backend import triton_rows_attention  # noqa: E402
from tests.attention_cases import CASES, Case, k_copies_oracle, make_inputs, max_rel_err  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402

BLOCK = 8  # several query and key blocks per rank even at these sizes
CP_CASES = [c for c in CASES if c.name in ("groups", "gqa", "mqa_with_plain_sequence", "len1")]


def _rank_rows(rows_fn, case: Case, cp: int, rank: int):
    """One rank's rows without the collective: (out, dq) of its rows, dk / dv over all T keys."""
    x = make_inputs(case, seed=0)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    sl = build_cp_slice(layout, cp, rank)
    q = x.q[sl.local_index].clone().requires_grad_()
    k, v = (t.clone().requires_grad_() for t in (x.k, x.v))
    out = rows_fn(q, k, v, sl, layout, softmax_scale=1.0 / math.sqrt(case.d))
    (out * x.w[sl.local_index]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("case", CP_CASES, ids=lambda c: c.name)
def test_triton_rows_equal_reference_rows(case: Case, cp: int) -> None:
    triton_rows = functools.partial(triton_rows_attention, block=BLOCK)
    dk, dv, want_dk, want_dv = 0, 0, 0, 0
    for rank in range(cp):
        out, dq, gk, gv = _rank_rows(triton_rows, case, cp, rank)
        ref_out, ref_dq, ref_k, ref_v = _rank_rows(reference_rows_attention, case, cp, rank)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5, msg=f"rank {rank} out")
        assert max_rel_err(dq, ref_dq) <= 1e-5, f"rank {rank} dq"
        assert max_rel_err(gk, ref_k) <= 1e-5 and max_rel_err(gv, ref_v) <= 1e-5, f"rank {rank} dk/dv share"
        dk, dv, want_dk, want_dv = dk + gk, dv + gv, want_dk + ref_k, want_dv + ref_v
    oracle = k_copies_oracle(case, make_inputs(case, seed=0), 1.0 / math.sqrt(case.d))
    assert max_rel_err(dk, oracle.dk) <= 1e-5 and max_rel_err(dv, oracle.dv) <= 1e-5


def test_rows_at_wrong_positions_are_caught() -> None:
    """The check above is sensitive to q_pos: the same rows masked as if they sat at 0..T_r-1."""
    case = next(c for c in CP_CASES if c.name == "groups")
    x = make_inputs(case, seed=0)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    sl = build_cp_slice(layout, 2, 1)
    rows, scale = sl.local_index, 1.0 / math.sqrt(case.d)
    gs, pe, ss = (t[rows] for t in (layout.group_start, layout.prefix_end, layout.seg_start))
    n = layout.total_tokens
    wrong = build_block_plan(gs, pe, ss, block_m=BLOCK, block_n=BLOCK, device="cpu", num_keys=n)
    out = shared_prompt_flash_attention(x.q[rows], x.k, x.v, wrong, scale)
    ref = reference_rows_attention(x.q[rows], x.k, x.v, sl, layout, softmax_scale=scale)
    assert max_rel_err(out, ref) > 0.1


def _cp_worker(cases: list[Case]):
    import torch.distributed as dist

    from megatron_rl.attention import context_parallel

    dist.init_process_group("gloo")
    # small blocks so the CP path crosses block edges at these sizes
    context_parallel._ROWS_IMPLS["triton"] = functools.partial(triton_rows_attention, block=BLOCK)
    return [[_cp_case(case, backend) for backend in ("triton", "reference")] for case in cases]


def _cp_case(case: Case, backend: str):
    import torch.distributed as dist

    from megatron_rl.attention.context_parallel import cp_attention

    x = make_inputs(case, seed=0)
    layout = AttentionLayout.from_lengths(case.prompt_lens, case.response_lens)
    sl = build_cp_slice(layout, dist.get_world_size(), dist.get_rank())
    q, k, v = (t[sl.local_index].clone().requires_grad_() for t in (x.q, x.k, x.v))
    out = cp_attention(q, k, v, layout, sl, backend=backend, group=dist.group.WORLD)
    (out * x.w[sl.local_index]).sum().backward()
    return sl.local_index, out.detach(), q.grad, k.grad, v.grad


def _assemble(case: Case, per_rank):
    x = make_inputs(case, seed=0)
    full = [torch.zeros_like(t) for t in (x.q, x.q, x.k, x.v)]
    for idx, *parts in per_rank:
        for acc, part in zip(full, parts, strict=True):
            acc[idx] = part
    return full


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_attention_triton_equals_reference(cp: int) -> None:
    """End to end over gloo: K / V all-gathered, dK / dV reduce-scattered, every rank's rows."""
    per_rank = run_distributed(_cp_worker, cp, CP_CASES)
    for i, case in enumerate(CP_CASES):
        got = _assemble(case, [r[i][0] for r in per_rank])
        want = _assemble(case, [r[i][1] for r in per_rank])
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5, msg=case.name)
        for name, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:], strict=True):
            assert max_rel_err(g, w) <= 1e-5, f"{case.name} {name}"
        oracle = k_copies_oracle(case, make_inputs(case, seed=0), 1.0 / math.sqrt(case.d))
        torch.testing.assert_close(got[0], oracle.out, atol=1e-5, rtol=1e-5, msg=case.name)
