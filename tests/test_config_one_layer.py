"""One validation layer: a component built from Python refuses a bad value with the very problem
(key and message) the config loader reports for the same value, every registry keyed by a
schema ``Literal`` holds exactly its names, and ``config/`` imports nothing above it."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from megatron_rl.algorithms import LossSettings, MismatchAlarm, RolloutCorrection
from megatron_rl.config import ConfigError, config_from_dict, schema
from megatron_rl.control import SAGCSettings
from megatron_rl.pipeline import PipelineSettings
from megatron_rl.rollout import EngineSettings, SamplingSettings

CONFIG_DIR = Path(__file__).resolve().parents[1] / "megatron_rl" / "config"
HF = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64}


def _config_problems(override: str) -> set[tuple[str, str]]:
    base = {"model": {"hf_path": "/m"}, "data": {"source": "reasoning_gym:x"}, "trainer": {"steps": 1}}
    with pytest.raises(ConfigError) as info:
        config_from_dict(base, [override], hf_config=HF)
    return {(p.key, p.message) for p in info.value.problems}


@pytest.mark.parametrize(
    ("override", "build"),
    [
        ("rollout.engine=sglang", lambda: EngineSettings(model_path="/m", engine="sglang")),
        ("rollout.dtype=float16", lambda: EngineSettings(model_path="/m", dtype="float16")),
        ("rollout.num_engines=0", lambda: EngineSettings(model_path="/m", num_engines=0)),
        ("rollout.tensor_parallel_size=2", lambda: EngineSettings(model_path="/m", tensor_parallel_size=2)),
        ("rollout.devices=[gpu:0]", lambda: EngineSettings(model_path="/m", devices=["gpu:0"])),
        ("rollout.sampling.top_p=0", lambda: SamplingSettings(top_p=0.0)),
        ("pipeline.queue_size=0", lambda: PipelineSettings(queue_size=0)),
        ("pipeline.max_staleness=1", lambda: PipelineSettings(max_staleness=1)),
        ("algorithm.clip.low=0", lambda: LossSettings(clip_low=0.0)),
        ("algorithm.clip.high=0.1", lambda: LossSettings(clip_high=0.1)),
        ("algorithm.kl.estimator=k4", lambda: LossSettings(kl_estimator="k4")),
        ("algorithm.behav_weight_cap=0.5", lambda: LossSettings(behav_weight_cap=0.5)),
        ("algorithm.rollout_correction.c_min=5", lambda: RolloutCorrection(c_min=5.0)),
        ("algorithm.mismatch_alarm.action=panic", lambda: MismatchAlarm(action="panic")),
        ("control.sagc.gamma=1.5", lambda: SAGCSettings(gamma=1.5)),
        ("control.sagc.candidates=[8, 4]", lambda: SAGCSettings(candidates=[8, 4], initial=8)),
    ],
)
def test_a_component_reports_what_the_config_reports(override, build):
    with pytest.raises(ConfigError) as info:
        build()
    assert {(p.key, p.message) for p in info.value.problems} <= _config_problems(override)


def test_registries_hold_the_schemas_names():
    from megatron_rl.attention.backends import _IMPLS, BACKENDS
    from megatron_rl.rollout.worker import BACKEND_CLASSES
    from megatron_rl.trainer.build import DTYPES
    from megatron_rl.weight_sync.group import GROUP_BACKENDS

    assert set(BACKEND_CLASSES) == set(get_args(schema.EngineName))
    assert BACKENDS == get_args(schema.AttentionBackend) and set(_IMPLS) == set(BACKENDS) - {"auto"}
    assert set(GROUP_BACKENDS) == set(get_args(schema.DeviceKind))
    assert set(DTYPES) == set(get_args(schema.DType))


def test_config_imports_nothing_above_it():
    upward = []
    for path in sorted(CONFIG_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            upward += [
                f"{path.name}: {n}"
                for n in names
                if n.startswith("megatron_rl") and not n.startswith("megatron_rl.config")
            ]
    assert not upward, upward
