"""Load a `Config` from YAML plus ``a.b.c=value`` overrides, and save it back.

Contract: `load_config` is the only way a run gets its config. It parses the file (keeping
the line of every key), applies the command-line overrides in order (each value parsed with
YAML scalar rules: ``x=3`` is an int, ``x=[4,8]`` a list, ``x=null`` None, ``x=1e-6`` a
float), converts to typed dataclasses and runs every check in `validate.py`. Any mistake
raises one `ConfigError` listing all problems, each as ``file:line: key: message``
(``command line: key: message`` for overrides). `config_to_dict` / `config_from_dict` round
trip exactly, for saving the config next to a checkpoint.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from .convert import SCIENTIFIC_FLOAT, describe, field_types, from_plain, join, to_plain
from .errors import COMMAND_LINE, ConfigError, Origins, Problem, suggest
from .resources import check_resources
from .schema import Config
from .validate import validate


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads YAML 1.2 floats such as 1e-6 (YAML 1.1 needs a dot)."""


_Loader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", SCIENTIFIC_FLOAT, list("-+0123456789."))


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    hf_config: dict[str, Any] | None = None,
    resources: bool = False,
) -> Config:
    """Read YAML `path`, apply `overrides` ("a.b.c=value"), convert and validate.

    `hf_config` stands in for ``<model.hf_path>/config.json`` (tests); None reads the file.
    `resources`: also check what the config points at (`resources.check_resources`: data file,
    tokenizer, dotted paths), as ``check-config`` and ``train`` do.
    Raises ConfigError naming every bad key with its file line (or "command line").
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError([Problem(key="<file>", message=f"no such config file: {path}", where=str(path))])
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([Problem(key="<file>", message=f"not UTF-8 text: {exc}", where=str(path))]) from exc
    data, origins, problems = parse_yaml(text, source=str(path))
    cfg = _build(data, origins, problems, overrides, hf_config=hf_config, check=True)
    found = list(check_resources(cfg)) if resources else []
    if found:
        raise ConfigError(Problem(key=k, message=m, where=origins.where(k)) for k, m in found)
    return cfg


def config_from_dict(
    data: dict[str, Any],
    overrides: Sequence[str] = (),
    *,
    hf_config: dict[str, Any] | None = None,
    check: bool = True,
) -> Config:
    """Build a Config from plain nested dicts (e.g. `config_to_dict` output or a saved YAML).

    `check=False` skips `validate` (only keys and types are checked), e.g. to inspect a
    config whose model directory is not on this machine.
    """
    return _build(data, Origins(), [], overrides, hf_config=hf_config, check=check)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dicts of `cfg`; `config_from_dict(config_to_dict(cfg)) == cfg`."""
    return to_plain(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write `cfg` as YAML to `path` (loadable again with `load_config`)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def parse_yaml(text: str, *, source: str) -> tuple[Any, Origins, list[Problem]]:
    """YAML text -> (plain data, line of every key, problems such as duplicate keys)."""
    origins, problems = Origins(source=source), []
    loader = None
    try:
        loader = _Loader(text)  # checks the characters: a ReaderError is a YAMLError too
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError([Problem(key="<yaml>", message=f"invalid YAML: {exc}", where=where)]) from exc
    finally:
        if loader is not None:
            loader.dispose()
    if node is not None:
        _record_lines(node, "", source, origins, problems)
    return data, origins, problems


def _record_lines(node: yaml.Node, prefix: str, source: str, origins: Origins, problems: list[Problem]) -> None:
    """Walk the composed YAML tree recording "file:line" per dotted key; flag duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        first_line: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.value == "<<":
                continue
            key, line = join(prefix, key_node.value), key_node.start_mark.line + 1
            if key in first_line:  # PyYAML silently keeps the last one
                problems.append(
                    Problem(
                        key=key,
                        message=f"duplicate key (first at line {first_line[key]})",
                        where=f"{source}:{line}",
                    )
                )
            first_line.setdefault(key, line)
            origins.lines[key] = f"{source}:{line}"
            _record_lines(value_node, key, source, origins, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            origins.lines[f"{prefix}[{i}]"] = f"{source}:{item.start_mark.line + 1}"
            _record_lines(item, f"{prefix}[{i}]", source, origins, problems)


def apply_override(data: dict[str, Any], override: str, origins: Origins) -> Problem | None:
    """Set ``a.b.c=value`` in `data` in place, checking the path against the schema.

    Inside a pass-through dict (``model.megatron``, ``rollout.vllm``) any sub-path is allowed.
    Returns the Problem (unknown path, bad syntax) instead of applying, or None.
    """
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        return Problem(key=override, message="override must be key=value, e.g. trainer.lr=1e-5", where=COMMAND_LINE)
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        return Problem(key=key, message=f"value {text!r} is not valid YAML: {exc}", where=COMMAND_LINE)
    parts, cls, node = key.split("."), Config, data
    for i, part in enumerate(parts):
        if cls is not None:
            cls, problem = _descend(cls, parts, i)
            if problem is not None:
                return problem
        if i == len(parts) - 1:
            node[part] = value
        else:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
    origins.set(key, COMMAND_LINE)
    return None


def _descend(cls: type, parts: list[str], i: int) -> tuple[type | None, Problem | None]:
    """The section class under ``parts[i]`` of ``cls`` (None inside a pass-through dict), or the
    Problem of an unknown key or a non-section in the middle of the path."""
    path, part = ".".join(parts[: i + 1]), parts[i]
    types_ = field_types(cls)
    if part not in types_:
        return None, Problem(key=path, message=f"unknown key ({suggest(part, types_)})", where=COMMAND_LINE)
    tp = types_[part]
    if i == len(parts) - 1:
        return cls, None
    if dataclasses.is_dataclass(tp):
        return tp, None
    if typing.get_origin(tp) is dict:
        return None, None  # pass-through: the rest of the path is the upstream library's
    return None, Problem(key=path, message=f"is a {describe(tp)}, not a section", where=COMMAND_LINE)


def _build(
    data: Any,
    origins: Origins,
    problems: list[Problem],
    overrides: Sequence[str],
    *,
    hf_config: dict[str, Any] | None,
    check: bool,
) -> Config:
    """Overrides -> conversion -> validation, raising every problem found at the first failing stage."""
    data = {} if data is None else copy.deepcopy(data)  # overrides must not touch the caller's dict
    if overrides and isinstance(data, dict):
        problems += [p for p in (apply_override(data, o, origins) for o in overrides) if p is not None]
    try:
        cfg = from_plain(Config, data, origins=origins)
    except ConfigError as exc:
        raise ConfigError([*problems, *exc.problems]) from None
    if problems:
        raise ConfigError(problems)
    if check:
        validate(cfg, hf_config=hf_config, origins=origins)
    return cfg
