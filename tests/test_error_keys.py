"""Every config key a message of the package names exists in the schema, so an error never points
a user at a key they cannot write (e.g. ``rollout.num_workers`` for ``rollout.num_engines``)."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from pathlib import Path

from megatron_rl.config import schema

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_rl"
SECTIONS = tuple(f.name for f in dataclasses.fields(schema.Config))
KEY = re.compile(r"\b(?:" + "|".join(SECTIONS) + r")(?:\.[a-z_][a-z0-9_]*)+")
PASS_THROUGH = ("model.megatron.", "rollout.vllm.", "control.options.")  # dicts handed on untouched


def _resolves(key: str) -> bool:
    if key.startswith(PASS_THROUGH):
        return True
    node: type = schema.Config
    for part in key.split("."):
        hints = typing.get_type_hints(node)
        if part not in hints:
            return False
        hint = hints[part]
        node = hint if dataclasses.is_dataclass(hint) else None
        if node is None:
            return part == key.split(".")[-1]
    return True


def _messages(path: Path):
    """String pieces (f-string parts included) of every ``raise`` and ``yield key, message`` of the
    file (validate.py's checks), with their line numbers."""
    for stmt in ast.walk(ast.parse(path.read_text())):
        if isinstance(stmt, ast.Raise | ast.Yield):
            for node in ast.walk(stmt):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    yield node.lineno, node.value


def test_the_scan_finds_keys_and_rejects_a_wrong_one():
    assert _resolves("rollout.num_engines") and _resolves("algorithm.clip.high")
    assert not _resolves("rollout.num_workers") and not _resolves("rollout.backend")


def test_every_named_key_exists():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _messages(path):
            for key in KEY.findall(text):
                key = key.rstrip(".")
                if key.count(".") >= 1 and not _resolves(key):
                    bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {key}")
    assert not bad, "messages name keys that are not in the config schema:\n" + "\n".join(bad)
