"""Plain data (dicts, lists, scalars from YAML) <-> typed config dataclasses.

Contract: `from_plain(cls, data)` builds `cls` from nested dicts, checking every key and
type against the dataclass annotations, and raises one `ConfigError` listing every unknown
key, wrong type and missing required key (each named by dotted path, placed by `Origins`).
`to_plain(obj)` is its inverse: `from_plain(type(obj), to_plain(obj)) == obj`.
Supported annotations: int, float, bool, str, Any, Literal[...], Optional[X] / X | None,
list[X], dict[str, X] and nested dataclasses. Strict: a bool is not an int, an int is not a
str; an int is accepted for a float, and so is a string in scientific notation ("1e-6",
which YAML 1.1 leaves as a string). `type_problems` runs the same checks on one value. Range
and cross-field checks are `fields.py`'s, `sections.py`'s and `validate.py`'s job.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from .errors import ConfigError, Origins, Problem, suggest

# Floats written with an exponent and no dot ("1e-6", "3E5"), or with an unsigned exponent
# ("1.0e6"): YAML 1.2 floats that PyYAML's YAML 1.1 resolver leaves as strings.
SCIENTIFIC_FLOAT = re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$")

_BAD = object()  # sentinel: conversion of this value failed (a Problem was recorded)


def from_plain(cls: type, data: Any, *, origins: Origins | None = None) -> Any:
    """Build dataclass `cls` from plain nested data; raise ConfigError naming every bad key."""
    conv = _Converter(origins or Origins())
    out = conv.convert(cls, data, "")
    if conv.problems:
        raise ConfigError(conv.problems)
    return out


def to_plain(obj: Any) -> dict[str, Any]:
    """Dataclass -> nested dicts/lists/scalars (deep copy), ready for YAML or JSON."""
    return dataclasses.asdict(obj)


def type_problems(tp: Any, value: Any, key: str) -> list[tuple[str, str]]:
    """``(key, message)`` for each way `value` does not fit annotation `tp` (the checks and the
    messages of loading), e.g. for a settings object built from Python; [] when it fits."""
    conv = _Converter(Origins())
    conv.convert(tp, value, key)
    return [(p.key, p.message) for p in conv.problems]


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of dataclass `cls`'s init fields, in declaration order."""
    return _field_types(cls)


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def is_required(cls: type, name: str) -> bool:
    """True when field `name` of dataclass `cls` has neither a default nor a factory."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def describe(tp: Any) -> str:
    """Human name of an annotation, e.g. 'float', 'one of grpo, dapo', 'list of int'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args if a is not type(None)) + " or null"
    if origin is list:
        return f"list of {describe(args[0])}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "mapping (section)"
    return getattr(tp, "__name__", str(tp))


def show(value: Any) -> str:
    """Short repr of a user value with its YAML-ish type, for error messages."""
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = {bool: "bool", int: "int", float: "float", str: "string", type(None): "null"}
    return f"{text} ({kind.get(type(value), type(value).__name__)})"


def join(prefix: str, name: str) -> str:
    """Dotted path of `name` under `prefix` ('' is the root)."""
    return f"{prefix}.{name}" if prefix else name


class _Converter:
    """One conversion pass; collects every Problem instead of stopping at the first."""

    def __init__(self, origins: Origins):
        self.origins = origins
        self.problems: list[Problem] = []

    def fail(self, key: str, message: str) -> object:
        self.problems.append(Problem(key=key, message=message, where=self.origins.where(key)))
        return _BAD

    def convert(self, tp: Any, value: Any, key: str) -> Any:
        if dataclasses.is_dataclass(tp):
            return self.section(tp, value, key)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin is Literal:
            if value in args and type(value) in {type(a) for a in args}:
                return value
            hint = suggest(value, [str(a) for a in args]) if isinstance(value, str) else ""
            hint = f"; {hint}" if hint.startswith("did you mean") else ""
            return self.fail(key, f"expected {describe(tp)}, got {show(value)}{hint}")
        if origin in (Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            (inner,) = [a for a in args if a is not type(None)]  # only Optional[X] is supported
            return self.convert(inner, value, key)
        if origin is list:
            return self.sequence(args[0], value, key)
        if origin is dict:
            return self.mapping(args[1], value, key)
        return self.scalar(tp, value, key)

    def scalar(self, tp: Any, value: Any, key: str) -> Any:
        if tp is Any:
            return value
        if tp is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if isinstance(value, str) and SCIENTIFIC_FLOAT.match(value.strip()):
                return float(value)
        elif tp is int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif isinstance(value, tp):  # bool, str
            return value
        return self.fail(key, f"expected {describe(tp)}, got {show(value)}")

    def sequence(self, item_tp: Any, value: Any, key: str) -> Any:
        if not isinstance(value, (list, tuple)):
            return self.fail(key, f"expected {describe(list[item_tp])}, got {show(value)}; write [a, b, ...]")
        items = [self.convert(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return _BAD if any(v is _BAD for v in items) else items

    def mapping(self, value_tp: Any, value: Any, key: str) -> Any:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            return self.fail(key, f"expected a mapping of options, got {show(value)}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                self.fail(join(key, str(k)), f"option names must be strings, got {show(k)}")
                continue
            out[k] = self.convert(value_tp, v, join(key, k))
        return _BAD if any(v is _BAD for v in out.values()) else out

    def section(self, cls: type, value: Any, key: str) -> Any:
        if value is None:  # "algorithm:" with every line commented out
            value = {}
        if not isinstance(value, Mapping):
            return self.fail(key or "<root>", f"expected a mapping (section), got {show(value)}")
        before = len(self.problems)
        types_ = field_types(cls)
        for name in value:
            if name not in types_:
                self.fail(join(key, str(name)), f"unknown key ({suggest(str(name), types_)})")
        kwargs = {}
        for name, tp in types_.items():
            if name in value:
                kwargs[name] = self.convert(tp, value[name], join(key, name))
            elif is_required(cls, name):
                self.fail(join(key, name), _missing_message(tp, key))
        if len(self.problems) > before:
            return _BAD
        return cls(**kwargs)


def _missing_message(tp: Any, parent: str) -> str:
    """Message for a required key that is absent, saying what to add and where."""
    under = f" under `{parent.rsplit('.', 1)[-1]}:`" if parent else " at the top level"
    if dataclasses.is_dataclass(tp):
        needed = [n for n in field_types(tp) if is_required(tp, n)]
        return f"missing required section{under}; it needs at least: {', '.join(needed)}"
    return f"missing required key; add it{under} ({describe(tp)})"
