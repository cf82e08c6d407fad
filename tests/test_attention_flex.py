"""FlexAttention backend on the CPU: forward only (torch 2.13 CPU FlexAttention has no
backward), no grad anywhere in this process; one combined case so it compiles once."""

import math

import pytest
import torch

from megatron_rl.attention import AttentionLayout, shared_prompt_attention
from tests.attention_cases import Case, k_copies_oracle, make_inputs

# several groups, ragged responses, K = 1, length-1 responses, a plain sequence, GQA
COMBINED = Case("combined", (7, 6, 5, 9, 4), ((3, 9, 1, 5), (4,), (1, 1, 1), (5, 2, 7), ()), hq=4, hkv=2)


@pytest.mark.slow
def test_flex_forward_matches_k_copies() -> None:
    x = make_inputs(COMBINED)
    layout = AttentionLayout.from_lengths(COMBINED.prompt_lens, COMBINED.response_lens)
    with torch.no_grad():
        out = shared_prompt_attention(x.q, x.k, x.v, layout, backend="flex")
    ref = k_copies_oracle(COMBINED, x, 1.0 / math.sqrt(COMBINED.d))
    torch.testing.assert_close(out, ref.out, atol=1e-5, rtol=1e-5)
