"""check-config rules of the ``agent`` section (``config.sections._agent``,
``validate.check_agent_generator``) and the import check of ``agent.run`` (``resources``):
each bad setting is refused with the key named."""

from __future__ import annotations

import pytest

from megatron_rl.config.resources import check_resources
from tests.test_config import error, load

RUN = "agent.run=tests.agent_fixtures:two_turn_agent"


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["rollout.generator=agent"], "agent.run", "needs agent.run"),
        ([RUN], "agent.run", "rollout.generator is 'auto'"),
        (["rollout.generator=agent", "agent.run=not a path"], "agent.run", "dotted path"),
        (["rollout.generator=agent", RUN, "environment.kind=echo"], "environment.kind", "its own tools"),
        (["rollout.generator=agent", RUN, "agent.host=0.0.0.0"], "agent.key", "not loopback"),
        (["rollout.generator=agent", RUN, "agent.workers=0"], "agent.workers", "> 0"),
        (["rollout.generator=agent", RUN, "agent.timeout_s=0"], "agent.timeout_s", "> 0"),
        (["rollout.generator=agent", RUN, "agent.max_total_tokens=-1"], "agent.max_total_tokens", "> 0"),
        (["rollout.generator=agent", RUN, "agent.port=70000"], "agent.port", "[0, 65535]"),
        (
            ["rollout.generator=agent", RUN, "algorithm.routing_replay=rollout"],
            "algorithm.routing_replay",
            "rollout.generator 'agent'",
        ),
        (
            ["rollout.generator=agent", RUN, "pipeline.micro_batch_tokens=1024"],
            "pipeline.micro_batch_tokens",
            ">= 4096",
        ),
    ],
)
def test_agent_rules_name_their_keys(tmp_path, overrides, key, words):
    err = error(tmp_path, overrides=overrides)
    assert set(err.keys) == {key} and f"{key}: " in str(err) and words in str(err)


def test_a_good_agent_section_passes_and_its_path_must_import(tmp_path):
    cfg = load(tmp_path, overrides=["rollout.generator=agent", RUN, "agent.host=0.0.0.0", "agent.key=s3cret"])
    assert cfg.agent.key == "s3cret" and cfg.rollout.generator == "agent"
    bad = load(tmp_path, overrides=["rollout.generator=agent", "agent.run=tests.agent_fixtures:nope"])
    assert [k for k, _ in check_resources(bad) if k == "agent.run"] == ["agent.run"]
    assert not [k for k, _ in check_resources(cfg) if k == "agent.run"]
