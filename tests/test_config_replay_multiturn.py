"""``check-config`` refuses multi-turn rollouts with MoE routing replay (issue 29, defect 9):
the engine returns routes per turn, never for a trajectory with its observation tokens, so
the pair used to validate and then fail at the first micro-batch."""

from __future__ import annotations

import json

import pytest

from megatron_rl.cli import main

# a tiny MoE config.json: the routing-replay rule wants experts, the model-shape rule a shape
MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}


@pytest.fixture
def config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MOE))
    path = tmp_path / "config.yaml"
    path.write_text(f"""\
model: {{hf_path: {model}}}
data: {{source: reasoning_gym:basic_arithmetic}}
rollout: {{engine: hf}}
pipeline: {{micro_batch_tokens: 8192}}
trainer: {{steps: 1}}
""")
    return str(path)


def check(config: str, *overrides: str) -> int:
    return main(["check-config", config, "--no-files", *overrides])


def test_multiturn_with_routing_replay_is_refused_naming_both_keys_and_the_fix(config, capsys):
    assert (
        check(config, "algorithm.routing_replay=rollout", "environment.kind=echo", "environment.max_total_tokens=4096")
        == 2
    )
    err = capsys.readouterr().err
    assert "algorithm.routing_replay: " in err and "environment.kind 'echo'" in err
    assert "routing_replay to 'none'" in err and "environment.kind to 'none'" in err


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.routing_replay=rollout",),  # single-turn replay
        ("algorithm.routing_replay=none", "environment.kind=echo", "environment.max_total_tokens=4096"),
    ],
)
def test_either_one_alone_still_validates(config, capsys, overrides):
    assert check(config, *overrides) == 0, capsys.readouterr().err
