"""Hypothesis fuzz of the config loader: random YAML text, random trees over the schema's keys
(and unknown ones) and random ``a.b=c`` overrides either load into a ``Config`` or raise
``ConfigError``, never another exception; plus the reliability keys' own checks."""

from __future__ import annotations

import dataclasses
import tempfile
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.config import Config, ConfigError, load_config
from megatron_rl.config.convert import field_types

HF = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}
BASE = {"model": {"hf_path": "/nonexistent/model"}, "data": {"source": "train.jsonl"}, "trainer": {"steps": 2}}
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _leaves(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (sections included)."""
    out = []
    for name, tp in field_types(cls).items():
        key = f"{prefix}{name}"
        out.append(key)
        if dataclasses.is_dataclass(tp):
            out += _leaves(tp, key + ".")
    return out


KEYS = _leaves()
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
_SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | _TEXT
_VALUE = st.recursive(
    _SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3), max_leaves=6
)
_KEY = st.sampled_from(KEYS) | st.sampled_from(KEYS).map(lambda k: k + ".typo") | _TEXT


def _load(text: str, overrides=()) -> Config | None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            return load_config(path, list(overrides), hf_config=HF)
        except ConfigError:
            return None


def _set(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def test_the_base_config_loads():
    assert isinstance(_load(yaml.safe_dump(BASE)), Config)


@FUZZ
@given(text=st.text(max_size=200))
def test_fuzz_yaml_text(text):
    _load(text)


@FUZZ
@given(changes=st.lists(st.tuples(_KEY, _VALUE), max_size=4))
def test_fuzz_trees_over_the_schema(changes):
    tree = yaml.safe_load(yaml.safe_dump(BASE))
    for key, value in changes:
        _set(tree, key, value)
    _load(yaml.safe_dump(tree, allow_unicode=True))


@FUZZ
@given(overrides=st.lists(st.tuples(_KEY, _TEXT).map("=".join) | _TEXT, max_size=4))
def test_fuzz_overrides(overrides):
    _load(yaml.safe_dump(BASE), overrides)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.request_timeout_s=0", "rollout.request_timeout_s"),
        ("rollout.max_restarts=-1", "rollout.max_restarts"),
        ("rollout.sync_address=0.0.0.0", "rollout.sync_address"),
        ("rollout.sync_address=my-host", "rollout.sync_address"),
        ("reward.timeout_s=-2", "reward.timeout_s"),
        ("data.skip_bad_rows=maybe", "data.skip_bad_rows"),
    ],
)
def test_reliability_keys_are_checked(override, key):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(BASE))
        with pytest.raises(ConfigError) as info:
            load_config(path, [override], hf_config=HF)
    assert key in info.value.keys


def test_reliability_keys_reach_the_engine_settings():
    from megatron_rl.trainer import from_config

    cfg = _load(
        yaml.safe_dump(BASE),
        [
            "rollout.request_timeout_s=7.5",
            "rollout.max_restarts=5",
            "rollout.sync_address=127.0.0.2",
            "reward.timeout_s=3",
        ],
    )
    engine = from_config.engine_settings(cfg)
    assert (engine.request_timeout_s, engine.max_restarts, engine.sync_address) == (7.5, 5, "127.0.0.2")
    assert from_config.reward_fn(cfg).timeout_s == 3
    assert typing.get_type_hints(type(cfg.data))["skip_bad_rows"] is bool
