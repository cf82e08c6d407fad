"""The ``agent/...`` counts reach the trainer's log: one RL step (tiny chat model, ``hf`` engine,
emulated device) whose agents crash, hang past ``agent.timeout_s``, send a malformed request,
start a second branch or take two turns (``tests.agent_fixtures.counting_agent``); the step's
``agent/...`` figures equal the totals of what the agents themselves logged, seen from the
``openai`` client (an independent count: replies received, errors caught, how each ended)."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

AGENT = [
    "rollout.generator=agent",
    "agent.run=tests.agent_fixtures:counting_agent",
    "agent.max_total_tokens=256",
    "agent.timeout_s=90",  # the hung agent sleeps 300 s; under load a first turn can take tens of seconds
    "pipeline.mode=sync",
]


def train_history(config_path: str, overrides: list[str]) -> list[dict]:
    """A rank's body: the run's metrics history."""
    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    return train(load_config(config_path, overrides), platform=TRAIN_PLATFORM)


def test_agent_counts_reach_the_trainer_log(tmp_path, monkeypatch):
    from tests.multiturn_fixtures import make_tiny_chat_model

    log = tmp_path / "agents.jsonl"
    monkeypatch.setenv("AGENT_LOG", str(log))
    model = make_tiny_chat_model(tmp_path / "model")
    config = tiny_rl_config(
        tmp_path,
        model,
        agent={"workers": 8},
        trainer={"steps": 1, "prompts_per_batch": 2},
        control={"kind": "fixed", "group_size": 4},
    )
    (history,) = run_distributed(
        train_history, 1, str(config), [*AGENT, f"trainer.save_dir={tmp_path / 'out'}"], timeout_s=600
    )
    did = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(did) == 8
    (step,) = history
    ended = [d["ended"] for d in did]
    want = {
        "agent/trajectories": len(did),
        "agent/crashed": ended.count("crashed"),
        "agent/timed_out": ended.count("timed_out"),
        "agent/bad_return": 0,
        "agent/failures": ended.count("crashed") + ended.count("timed_out"),
        "agent/malformed_requests": sum(d["malformed"] for d in did),
        "agent/turns": sum(d["turns"] for d in did),
        "agent/branches": sum(d["branches"] - 1 for d in did),
        "agent/tool_calls": sum(d["tool_calls"] for d in did),
        "agent/groups_failed": 0,
    }
    assert {k: step[k] for k in want} == want
    assert want["agent/crashed"] and want["agent/timed_out"] and want["agent/malformed_requests"]
    assert want["agent/branches"] and step["multiturn/env_failures"] == want["agent/failures"]
