"""The environment contract: loading by builtin name or dotted path, the errors naming the config
keys, the `environment` config section and check-config on it, and the deterministic toy."""

from __future__ import annotations

import pytest

from megatron_rl.config import load_config
from megatron_rl.data.records import ChatMessage, PromptRecord
from megatron_rl.environments import Environment, StepResult, load_environment, record_fields
from tests.test_check_config_files import _check, _config, _model


class NoStep:
    """Has tools and reset but no step: not an Environment."""

    tools: tuple[dict, ...] = ()

    def reset(self, record):
        return []


def counter_factory(*, turns: int):
    """A dotted-path factory function (not a class)."""
    return load_environment("echo", turns=turns)()


def test_builtin_and_dotted_path_make_fresh_environments():
    for spec in ("echo", "megatron_rl.environments.tasks:EchoCounter", "tests.test_environments:counter_factory"):
        factory = load_environment(spec, turns=2)
        first, second = factory(), factory()
        assert isinstance(first, Environment) and first is not second
    record = record_fields(PromptRecord(prompt_id="p", answer="3", text="1+2?"), instruction="Box it.")
    assert record["question"] == "1+2?" and record["messages"] == [{"role": "user", "content": "1+2?\n\nBox it."}]
    env = load_environment("echo", turns=2)()
    assert env.reset(record) == record["messages"]
    assert env.step("abcd") == StepResult(
        observation=({"role": "user", "content": "Turn 1: you wrote 4 characters. Go on."},), done=False
    )
    assert env.step("x") == StepResult(observation=(), done=True)


@pytest.mark.parametrize(
    ("spec", "options", "key", "words"),
    [
        ("ecko", {}, "environment.kind", "not one of"),
        ("no_such_pkg.mod:Env", {}, "environment.kind", "cannot import module"),
        ("os:path", {}, "environment.kind", "not a class or function"),
        ("tests.test_environments:NoStep", {}, "environment.kind", "missing step"),
        ("echo", {"turn": 2}, "environment.options", "unexpected keyword"),
        ("echo", {"turns": 0}, "environment.options", "turns must be"),
    ],
)
def test_load_errors_name_the_key(spec, options, key, words):
    with pytest.raises(ValueError, match=words) as err:
        load_environment(spec, **options)
    assert str(err.value).startswith(f"{key}:")


def test_chat_messages_round_trip():
    chat = (ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u"))
    record = record_fields(PromptRecord(prompt_id="p", answer="a", messages=chat))
    assert record["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"kind": "ecko"}, "environment.kind"),
        ({"kind": "none", "options": {"turns": 2}}, "environment.options"),
        ({"kind": "no_such_pkg:Env"}, "environment.kind"),
        ({"kind": "echo", "max_turns": 0}, "environment.max_turns"),
        ({"kind": "echo", "step_timeout_s": 0}, "environment.step_timeout_s"),
        ({"kind": "echo", "max_failures": -1}, "environment.max_failures"),
    ],
)
def test_check_config_refuses_bad_environment(tmp_path, capsys, env, key):
    model = _model(tmp_path)
    code, err = _check(capsys, _config(tmp_path, model, "reasoning_gym:basic_arithmetic", environment=env))
    assert code == 2 and f"{key}:" in err
    good = {"kind": "echo", "options": {"turns": 3}, "max_failures": None}
    cfg = load_config(_config(tmp_path, model, "reasoning_gym:basic_arithmetic", environment=good), resources=True)
    assert (cfg.environment.kind, cfg.environment.options, cfg.environment.max_failures) == ("echo", {"turns": 3}, None)
