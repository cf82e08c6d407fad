"""Config errors and where each key came from.

Contract: every user mistake in a config surfaces as one `ConfigError` (a `ValueError`)
holding one or more `Problem`s; each problem names the dotted key, says what is wrong
(with the offending value) and how to fix it, and carries the place the key was written:
``file.yaml:LINE``, ``command line`` for an ``a.b=c`` override, or the file alone when the
key was never written (a missing required key, a default). Nothing here knows the schema.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

COMMAND_LINE = "command line"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """One thing wrong with a config."""

    key: str  # dotted path, e.g. "algorithm.clip.high" or "rollout.sampling.stop[1]"
    message: str  # what is wrong and the fix, e.g. "unknown key (did you mean 'high'?)"
    where: str | None = None  # "path/config.yaml:12", "command line", or None if unknown

    def __str__(self) -> str:
        head = f"{self.where}: " if self.where else ""
        return f"{head}{self.key}: {self.message}"


class ConfigError(ValueError):
    """A config is invalid; `problems` lists every problem found, one per line in str()."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = tuple(problems)
        assert self.problems, "ConfigError needs at least one problem"
        super().__init__("\n".join(str(p) for p in self.problems))

    @property
    def keys(self) -> tuple[str, ...]:
        """The dotted keys named by the problems, in order."""
        return tuple(p.key for p in self.problems)


@dataclass
class Origins:
    """Where each dotted key was set: a file line or the command line.

    `where(key)` falls back to the nearest written ancestor (a missing key is reported at
    its parent mapping), then to the file itself.
    """

    source: str | None = None  # the YAML file, or None for a config built from a dict
    lines: dict[str, str] = field(default_factory=dict)  # dotted key -> "file:line" / COMMAND_LINE

    def set(self, key: str, where: str) -> None:
        """Record `key` as written at `where`, forgetting what its old sub-keys said."""
        prefix = key + "."
        for old in [k for k in self.lines if k.startswith((prefix, key + "["))]:
            del self.lines[old]
        self.lines[key] = where

    def where(self, key: str) -> str | None:
        """The place `key` (or its nearest recorded ancestor) was written."""
        probe = key
        while probe:
            if probe in self.lines:
                return self.lines[probe]
            probe = _parent(probe)
        return self.source


def _parent(key: str) -> str:
    """'a.b[2]' -> 'a.b'; 'a.b' -> 'a'; 'a' -> ''."""
    m = re.match(r"^(.*)(\[\d+\]|\.[^.\[]+)$", key)
    return m.group(1) if m else ""


def suggest(name: str, choices: Iterable[str]) -> str:
    """A fix hint for an unknown name: "did you mean 'x'?" or the list of valid names."""
    choices = sorted(choices)
    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    return "valid: " + ", ".join(choices) if len(choices) <= 20 else "see the schema"
