"""check-config's file checks of the model rewards: the judge's and the reward model's checkpoint
directories and a dotted judge parser, named by their keys, only when the reward uses them."""

from __future__ import annotations

from megatron_rl.config.reward_rules import check_reward_files
from megatron_rl.config.schema import RewardConfig
from megatron_rl.config.schema_reward_model import JudgeConfig, RewardModelConfig


def test_unused_components_are_not_checked():
    r = RewardConfig(judge=JudgeConfig(model="/nope", parser="no.such:parser"), model=RewardModelConfig(path="/nope"))
    assert list(check_reward_files(r)) == []


def test_used_components_name_their_keys(tmp_path):
    (tmp_path / "rm").mkdir()
    r = RewardConfig(
        kind="combined",
        weights={"judge": 1.0, "model": 1.0},
        judge=JudgeConfig(model=str(tmp_path / "missing"), parser="no_such_pkg.parsers:grade"),
        model=RewardModelConfig(path=str(tmp_path / "rm")),
    )
    found = list(check_reward_files(r))
    keys = [k for k, _ in found]
    assert keys.count("reward.judge.model") == 1 and "not a directory" in found[keys.index("reward.judge.model")][1]
    assert "reward.model.path" in keys and any("no config.json" in m for k, m in found if k == "reward.model.path")
    assert ("reward.judge.parser" in keys) and any("cannot import" in m for _, m in found)
