"""Every leaf of the config tree is read by the run: a knob that nothing reads is a silent lie.

The config is wrapped so that reading a leaf field is recorded (a section handed on whole, as
``vars(section)``, counts for all its leaves), then the real ``train`` runs one step on a tiny
model in the configurations of ``RUNS`` that between them take every branch that reads a section
(fixed G and SAGC, periodic and stale, overlong shaping, a reference model, agent rollouts). Validation, checkpoint
serialisation and the resolved config printed at the start, which read every field by
construction, run outside the recording.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_rl.config import schema
from tests.distributed import run_distributed
from tests.multiturn_fixtures import make_tiny_chat_model
from tests.reward_model_fixtures import make_tiny_reward_model
from tests.rl_fixtures import TRAIN_PLATFORM, tiny_rl_config


def leaves(cls=schema.Config, prefix="") -> set[str]:
    out = set()
    for f in dataclasses.fields(cls):
        hint = cls.__annotations__.get(f.name)
        sub = getattr(schema, hint, None) if isinstance(hint, str) else None
        if sub is not None and dataclasses.is_dataclass(sub):
            out |= leaves(sub, f"{prefix}{f.name}.")
        else:
            out.add(prefix + f.name)
    return out


READS: set[str] = set()
_TRACKED: dict[type, type] = {}
_PREFIX: dict[int, str] = {}  # id(tracked section) -> its dotted prefix (kept out of the section's __dict__)


def _tracked_class(cls: type) -> type:
    if cls not in _TRACKED:
        names = {f.name for f in dataclasses.fields(cls)}

        def __getattribute__(self, name):  # noqa: N807
            value = object.__getattribute__(self, name)
            prefix = _PREFIX[id(self)]
            if name in names and not dataclasses.is_dataclass(value):
                READS.add(prefix + name)
            elif name == "__dict__":  # the section handed on whole: every leaf below it
                READS.update(prefix + n for n in names)
            return value

        _TRACKED[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__})
    return _TRACKED[cls]


def tracked(node, prefix=""):
    """A copy of the frozen config tree whose leaf reads land in ``READS``."""
    if not dataclasses.is_dataclass(node):
        return node
    copy = object.__new__(_tracked_class(type(node)))
    _PREFIX[id(copy)] = prefix
    for f in dataclasses.fields(node):
        object.__setattr__(copy, f.name, tracked(getattr(node, f.name), f"{prefix}{f.name}."))
    return copy


def _train_tracked(config_path: str, overrides: list[str]) -> set[str]:
    from megatron_rl.config import load_config
    from megatron_rl.trainer import progress
    from megatron_rl.trainer.loop import train

    printed = progress.format_config

    def format_untracked(cfg):  # the resolved config printed at the start reads every leaf by design
        before = set(READS)
        out = printed(cfg)
        READS.clear()
        READS.update(before)
        return out

    progress.format_config = format_untracked
    cfg = tracked(load_config(config_path, overrides))  # validated before the recording starts
    READS.clear()
    train(cfg, platform=TRAIN_PLATFORM)
    return set(READS)


RUNS = {
    # on-policy distillation added to GRPO: the distill.* leaves (the teacher: the model itself)
    "periodic_fixed": [
        "pipeline.mode=periodic",
        "algorithm.kl.coef=0.1",
        "distill.teacher={model}",
        "distill.coef=0.5",
    ],
    "stale_sagc_overlong": [
        "pipeline.mode=stale",
        "pipeline.max_staleness=1",
        "algorithm.loss=ppo_decoupled",
        "control.kind=sagc",
        "control.sagc.candidates=[2, 4]",
        "control.group_size=2",
        "algorithm.overlong.enabled=true",
        "algorithm.overlong.buffer=4",
        # multi-turn (echo environment) in stale mode: the environment.* leaves
        "environment.kind=echo",
        "environment.options={turns: 2}",
        "environment.max_turns=2",
        "environment.max_total_tokens=200",
        "environment.step_timeout_s=30",
        "lora.rank=4",  # LoRA on the policy: the lora.* leaves (at rank 0, the default, only rank is read)
    ],
    # every reward source at once (reward.kind combined): the judge's and the reward model's leaves
    "model_rewards": [
        "reward.kind=combined",
        "reward.weights={function: 1.0, judge: 0.5, model: 0.5}",
        "reward.judge.model=<dir>/model",
        "reward.judge.dtype=float32",
        "reward.judge.max_new_tokens=4",
        "reward.model.path=<dir>/reward_model",
    ],
    # agent rollouts over the gateway (a deterministic two-turn openai agent): the agent.* leaves
    "agent": [
        "rollout.generator=agent",
        "agent.run=tests.agent_fixtures:two_turn_agent",
        "agent.workers=4",
        "agent.timeout_s=120",
        "agent.max_total_tokens=256",
        "pipeline.mode=sync",
        "control.group_size=2",
    ],
}


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("leaves")
    model = make_tiny_chat_model(tmp / "model")  # a chat template, for the multi-turn run (and the judge)
    make_tiny_reward_model(tmp / "reward_model")
    return str(tiny_rl_config(tmp, model, trainer={"steps": 1, "prompts_per_batch": 2}))


def test_the_tree_has_the_leaves_we_expect():
    found = leaves()
    assert {"rollout.sampling.seed", "control.sagc.tau", "model.megatron", "algorithm.advantage.eps"} <= found
    assert not any(key.endswith((".sampling", ".sagc", ".clip")) for key in found)  # sections are not leaves


@pytest.mark.slow
@pytest.mark.multiproc
def test_every_leaf_is_read_by_the_run(config):
    read = set()
    for name, overrides in RUNS.items():
        overrides = [o.replace("{model}", str(Path(config).parent / "model")) for o in overrides]
        overrides = [o.replace("<dir>", str(Path(config).parent)) for o in overrides]
        (got,) = run_distributed(_train_tracked, 1, config, overrides, timeout_s=600)
        if name == "periodic_fixed":  # the recording tells branches apart: no SAGC, no overlong here
            assert "control.sagc.candidates" not in got and "algorithm.overlong.buffer" not in got
            assert "control.sagc.tau" in got  # the fixed controller's straggler threshold
        read |= got
    unread = sorted(leaves() - read)
    assert not unread, f"config leaves read by nothing: {unread}"
