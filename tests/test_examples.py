"""Every shipped CPU recipe in ``examples/`` trains for a few steps on a tiny model.

Only keys that size the run are overridden (the model, lengths, step count, where logs go; the
tiny char-level tokenizer has no chat template), so a shipped combination of pipeline mode, loss
and controller can never crash again unnoticed. The stale + SAGC recipe runs 8 steps: the
combination that used to fail at step 6.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, train_run

REPO = Path(__file__).resolve().parents[1]
OWN_TESTS = {"moe_replay_smollm2": "tests/test_example_moe.py (an MoE model)"}  # recipes run elsewhere
RECIPES = sorted(p.parent.name for p in (REPO / "examples").glob("*/config.yaml") if p.parent.name not in OWN_TESTS)
STEPS = {"ppo_stale_smollm2": 8}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_rl_model(tmp_path_factory.mktemp("examples") / "model")


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    """For multi-turn recipes (an ``environment`` section): the chat template renders the tools."""
    from tests.multiturn_fixtures import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("examples") / "chat_model")


def test_every_recipe_is_covered():
    assert {"demo", "grpo_smollm2", "dapo_smollm2", "ppo_stale_smollm2", "tool_calc_smollm2", "lora_smollm2"} <= set(
        RECIPES
    )


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_on_a_tiny_model(recipe, request, tmp_path):
    steps = STEPS.get(recipe, 2)
    shipped = yaml.safe_load((REPO / "examples" / recipe / "config.yaml").read_text())
    multiturn = "environment" in shipped or "agent" in shipped  # an agent's chat goes through the template too
    model = request.getfixturevalue("tiny_chat_model" if multiturn else "tiny_model")
    overrides = [
        f"model.hf_path={model}",
        "data.chat_template=false",
        "data.size=32",
        "rollout.sampling.max_new_tokens=16",
        f"trainer.steps={steps}",
        f"trainer.log_dir={tmp_path}",
        "algorithm.overlong.buffer=4",
    ]
    if multiturn:  # one character a token: the tool description and the worked examples are ~1500 tokens
        overrides += ["pipeline.micro_batch_tokens=2400"]
        overrides.append("agent.max_total_tokens=1800" if "agent" in shipped else "environment.max_total_tokens=1800")
    judged = (
        yaml.safe_load((REPO / "examples" / recipe / "config.yaml").read_text()).get("reward", {}).get("kind")
        == "judge"
    )
    if judged:  # the tiny model judges too (SmolLM2 judges itself in the recipe); it has no chat template
        overrides += [f"reward.judge.model={model}", "reward.judge.chat_template=false"]
    if "distill" in yaml.safe_load((REPO / "examples" / recipe / "config.yaml").read_text()):
        overrides.append(f"distill.teacher={model}")  # the teacher: the tiny model itself (same tokenizer)
    (history,) = run_distributed(
        train_run, 1, str(REPO / "examples" / recipe / "config.yaml"), overrides, timeout_s=900
    )
    assert [h["train/version"] for h in history] == [float(v) for v in range(1, steps + 1)]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == steps
    if multiturn:
        assert all(h["multiturn/model_tokens"] > 0 for h in history)
    if judged:  # every response went to the judge's engines and got a verdict, read or counted unparsed
        assert history[-1]["reward/calls"] > 0 and "reward/failures_unparsed" in history[-1]
    if recipe == "ppo_stale_smollm2":  # the engine probe measures every step; δ masking is on (stale samples too)
        assert all(h["mismatch_probe/n_tokens"] > 0 and "mismatch/delta_dropped_tokens" in h for h in history)
