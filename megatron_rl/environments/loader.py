"""Build an environment factory from its config spec: a builtin name or a dotted path.

Contract: `load_environment(spec, **options)` returns an `EnvironmentFactory` (called once per
trajectory, with no arguments) for ``environment.kind`` = a builtin name (`BUILTIN_ENVIRONMENTS`)
or ``"pkg.mod:Factory"`` (a class or function taking ``**options``). It builds one instance
right away and checks it against the `Environment` protocol, so a bad path, bad options or a
missing method fail before any rollout, with a ``ValueError`` naming ``environment.kind`` /
``environment.options``. ``"none"`` (single-turn rollouts) is not an environment.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

from megatron_rl.config.resources import find_dotted
from megatron_rl.environments.base import Environment, EnvironmentFactory

BUILTIN_ENVIRONMENTS: dict[str, str] = {  # environment.kind name -> dotted path
    "echo": "megatron_rl.environments.tasks:EchoCounter",
    "calculator": "megatron_rl.environments.tasks:CalculatorArithmetic",
    "python": "megatron_rl.environments.tasks:PythonArithmetic",
}
KIND_KEY, OPTIONS_KEY = "environment.kind", "environment.options"


def load_environment(spec: str, **options: Any) -> EnvironmentFactory:
    """The factory of fresh environments named by `spec`, bound to `options`; ValueError naming
    the config key when it does not import, does not accept the options or is no `Environment`."""
    path = BUILTIN_ENVIRONMENTS.get(spec, spec)
    if ":" not in path:
        names = ", ".join(sorted(BUILTIN_ENVIRONMENTS))
        raise ValueError(f"{KIND_KEY}: {spec!r} is not one of {names} or a dotted path 'pkg.mod:Factory'")
    target, why = find_dotted(path)
    if why:
        raise ValueError(f"{KIND_KEY}: {spec!r}: {why}")
    if not callable(target):
        raise ValueError(
            f"{KIND_KEY}: {spec!r} is a {type(target).__name__}, not a class or function returning an Environment"
        )
    _check_options(spec, target, options)
    factory = functools.partial(target, **options)
    try:
        env = factory()
    except (TypeError, ValueError) as err:  # the factory refusing an option's value
        raise ValueError(f"{OPTIONS_KEY}: {spec!r} refused {dict(options)}: {err}") from err
    _check_instance(spec, env)
    return factory


def _check_options(spec: str, target: Any, options: Mapping[str, Any]) -> None:
    """The factory accepts `options` as keyword arguments."""
    try:
        inspect.signature(target).bind(**options)
    except TypeError as err:
        raise ValueError(f"{OPTIONS_KEY}: {dict(options)} do not fit {spec!r}: {err}") from err
    except ValueError:  # no signature (a builtin callable): the call below will tell
        pass


def _check_instance(spec: str, env: Any) -> None:
    """`env` has tools (a tuple of dicts), reset and step."""
    if not isinstance(env, Environment):
        missing = [name for name in ("tools", "reset", "step") if not hasattr(env, name)]
        raise ValueError(
            f"{KIND_KEY}: {spec!r} made a {type(env).__name__}, which is not an Environment "
            f"(missing {', '.join(missing)}); see megatron_rl.environments.base"
        )
    bad = not isinstance(env.tools, tuple) or not all(isinstance(t, dict) for t in env.tools)
    if bad or not callable(env.reset) or not callable(env.step):
        raise ValueError(
            f"{KIND_KEY}: {spec!r} made a {type(env).__name__} whose tools is not a tuple of "
            "JSON-schema dicts or whose reset / step is not a method"
        )
