"""RL with the agent generator (``rollout.generator: agent``) on the emulated device: a
deterministic two-turn ``openai`` agent through the gateway; periodic == sync (the weights after
3 steps), every engine turn sampled from θ_t (a teacher-forced transformers forward of the
step's checkpoint), and each trained trajectory is two model turns with a tool observation
between them (mask 0)."""

from __future__ import annotations

import pytest

from tests.rl_fixtures import tiny_rl_config
from tests.test_rl_loop import _run, assert_engine_sampled_from_trained_weights, assert_same_update

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

AGENT = ["rollout.generator=agent", "agent.run=tests.agent_fixtures:two_turn_agent", "agent.max_total_tokens=256"]


@pytest.fixture(scope="module")
def agent_setup(tmp_path_factory):
    from tests.multiturn_fixtures import make_tiny_chat_model

    tmp = tmp_path_factory.mktemp("rl_agent")
    model = make_tiny_chat_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        agent={"workers": 4, "timeout_s": 300},
        trainer={"steps": 3, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
    )
    return tmp, str(config)


def test_agent_generator_periodic_equals_sync(agent_setup):
    tmp, config = agent_setup
    sync_dir, sync_hist, sync_results = _run(tmp, config, "agent_sync", 1, [*AGENT, "pipeline.mode=sync"])
    per_dir, per_hist, per_results = _run(
        tmp, config, "agent_periodic", 1, [*AGENT, "pipeline.mode=periodic", "rollout.max_batch_size=4"]
    )
    assert_same_update(tmp, sync_dir, per_dir, tol=1e-4)
    for out, results in ((sync_dir, sync_results), (per_dir, per_results)):
        assert len(results) == 3 * 4 * 4 * 2  # every trajectory's two turns
        assert_engine_sampled_from_trained_weights(tmp, out, results)
    for hist in (sync_hist, per_hist):
        assert all(h["multiturn/turns_mean"] == 2 and h["multiturn/observation_tokens"] > 0 for h in hist)
        assert all(h["multiturn/env_failures"] == 0 for h in hist)
