"""``examples/moe_replay_smollm2`` (GRPO with routing replay, bf16 hf engine, fp32 trainer) trains
two steps on a tiny random Qwen3-MoE with the char tokenizer (``models.synthetic.write_char_moe``).

Only what sizes the run is overridden, as in ``test_examples``. Checked: two optimizer steps
(a weight sync of the expert tensors into the engine between them), every step's engine / trainer
mismatch measured on its tokens with routes replayed (``mismatch/n_tokens`` > 0, the bf16 gap
small: ``mismatch/kl_k3`` < 1e-3).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import train_run

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_moe_replay_example_trains_two_steps(tmp_path):
    from megatron_rl.models.synthetic import write_char_moe

    model = write_char_moe(tmp_path / "model")
    overrides = [
        f"model.hf_path={model}",
        "data.chat_template=false",
        "data.size=32",
        "rollout.sampling.max_new_tokens=16",
        "trainer.steps=2",
        f"trainer.log_dir={tmp_path}",
    ]
    (history,) = run_distributed(
        train_run, 1, str(REPO / "examples/moe_replay_smollm2/config.yaml"), overrides, timeout_s=900
    )
    assert [h["train/version"] for h in history] == [1.0, 2.0]
    for h in history:
        assert h["mismatch/n_tokens"] > 0 and h["mismatch/kl_k3"] < 1e-3
