"""The ``reward`` section's rules for model rewards (run by ``sections.py`` for the ``reward`` key):
which components ``reward.kind`` / ``reward.weights`` use, and that each used one is complete
(a judge's checkpoint, template and parser; a reward model's checkpoint and devices)."""

from __future__ import annotations

import re
from typing import Any, get_args

from .devices import parse_device
from .errors import suggest
from .fields import Found
from .schema_reward_model import JUDGE_PLACEHOLDERS, REWARD_COMPONENTS, BuiltinParser
from .sections import DOTTED_PATH

BUILTIN_PARSERS: tuple[str, ...] = get_args(BuiltinParser)
PLACEHOLDER = re.compile(r"\{(\w+)\}")  # a judge template's {name}


def template_problems(template: str, rubric: str) -> list[str]:
    """What is wrong with a judge template: an unknown placeholder, a missing {question} /
    {response}, or a rubric it has no {rubric} for ([] when it is usable)."""
    names = set(PLACEHOLDER.findall(template))
    problems = [f"unknown placeholder {{{n}}}" for n in sorted(names - set(JUDGE_PLACEHOLDERS))]
    problems += [f"no {{{n}}} placeholder" for n in ("question", "response") if n not in names]
    if rubric and "rubric" not in names:
        problems.append("no {rubric} placeholder for reward.judge.rubric")
    return problems


def used_components(r: Any) -> list[str]:
    """The reward sources a ``reward`` section uses: its kind, or the names of reward.weights."""
    return list(r.weights) if r.kind == "combined" else [r.kind]


def model_reward_rule(r: Any) -> Found:
    """reward.kind vs reward.weights, then the judge and the reward model when used."""
    yield from _weights(r)
    used = used_components(r)
    if "judge" in used:
        yield from _judge(r.judge)
    if "model" in used:
        yield from _model(r.model)


def _weights(r: Any) -> Found:
    if r.kind != "combined" and r.weights:
        yield "reward.weights", f"are only for reward.kind 'combined', got kind {r.kind!r}; remove them or use combined"
    if r.kind == "combined" and not r.weights:
        yield "reward.weights", "reward.kind 'combined' needs a weight per component, e.g. {function: 1.0, judge: 0.5}"
    for name in r.weights:
        if name not in REWARD_COMPONENTS:
            names, hint = ", ".join(REWARD_COMPONENTS), suggest(name, REWARD_COMPONENTS)
            yield "reward.weights", f"names an unknown component {name!r}; use {names} ({hint})"


def _judge(j: Any) -> Found:
    if not j.model:
        yield "reward.judge.model", "the reward uses an LLM judge: give its checkpoint directory"
    for problem in template_problems(j.template, j.rubric):
        yield (
            "reward.judge.template",
            f"{problem} (placeholders: {{question}}, {{response}}, {{reference}}, {{rubric}})",
        )
    if j.parser not in BUILTIN_PARSERS and not DOTTED_PATH.match(j.parser):
        names, hint = ", ".join(BUILTIN_PARSERS), suggest(j.parser, BUILTIN_PARSERS)
        yield "reward.judge.parser", f"{j.parser!r} is not one of {names} or a dotted path 'pkg.mod:function' ({hint})"
    yield from _devices("reward.judge.devices", j.devices, one_id=j.engine == "hf")


def _model(m: Any) -> Found:
    if not m.path:
        yield "reward.model.path", "the reward uses a reward model: give its checkpoint directory"
    if not m.devices:
        yield "reward.model.devices", "give one device string per reward-model worker, e.g. ['cpu']"
    yield from _devices("reward.model.devices", m.devices, one_id=True)


def _devices(key: str, devices: list[str], *, one_id: bool) -> Found:
    for i, text in enumerate(devices):
        try:
            device = parse_device(text, f"{key}[{i}]")
        except ValueError as err:
            yield key, str(err)
            continue
        if one_id and device.kind != "cpu" and len(device.ids) != 1:
            yield key, f"[{i}] = {text!r}: each worker runs on one device, e.g. '{device.kind}:{device.ids[0]}'"


def check_reward_files(r: Any) -> Found:
    """The judge's and the reward model's checkpoint directories, and a dotted judge parser's
    import, when the reward uses them (run by ``resources.check_resources``)."""
    from .resources import check_model_dir, find_dotted

    used = used_components(r)
    dirs = {"reward.judge.model": r.judge.model if "judge" in used else None}
    dirs["reward.model.path"] = r.model.path if "model" in used else None
    for key, path in dirs.items():
        if path:
            yield from ((key, why) for _, why in check_model_dir(path))
    if "judge" in used and ":" in r.judge.parser:
        _, why = find_dotted(r.judge.parser)
        if why:
            yield "reward.judge.parser", f"{r.judge.parser!r}: {why}"
