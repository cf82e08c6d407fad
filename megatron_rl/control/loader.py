"""Build a group-size controller from its name: `fixed`, `sagc`, or a user class given by dotted
path `package.module:ClassName` (constructed with keyword `options`, then checked against the
`GroupSizeController` protocol)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_rl.config.fields import raise_found
from megatron_rl.config.resources import find_dotted
from megatron_rl.config.sections import controller_rule
from megatron_rl.control.base import DEFAULT_TAU, GroupSizeController
from megatron_rl.control.fixed import FixedController
from megatron_rl.control.sagc import SAGCController, SAGCSettings


def load_controller(
    spec: str,
    *,
    group_size: int | None = None,
    settings: SAGCSettings | None = None,
    options: Mapping[str, Any] | None = None,
    tau: float | None = None,
) -> GroupSizeController:
    """Return a controller for `spec`.

    spec: "fixed" (needs `group_size`; its straggler threshold is `tau`, else `settings.tau`),
          "sagc" (uses `settings`, default SAGCSettings()), or "package.module:ClassName",
          called as ClassName(**options).
    """
    raise_found(controller_rule(spec, options or {}))  # the config's control.kind / control.options rule
    if spec == "fixed":
        if group_size is None:
            raise ValueError("controller 'fixed' needs group_size")
        return FixedController(group_size, tau=tau if tau is not None else settings.tau if settings else DEFAULT_TAU)
    if spec == "sagc":
        return SAGCController(settings if settings is not None else SAGCSettings())
    return _load_dotted(spec, dict(options or {}))


def _load_dotted(spec: str, options: dict[str, Any]) -> GroupSizeController:
    factory, why = find_dotted(spec)  # the import check-config runs too
    if why or not callable(factory):
        # ValueError, not TypeError: a wrong spec is a config mistake (STYLE.md rule 4).
        raise ValueError(f"controller {spec!r}: {why or 'is not callable'}")
    controller = factory(**options)
    if not isinstance(controller, GroupSizeController):
        missing = [
            m
            for m in ("choose", "observe", "state_dict", "load_state_dict", "metrics")
            if not callable(getattr(controller, m, None))
        ]
        raise ValueError(  # noqa: TRY004
            f"controller {spec!r} does not implement GroupSizeController (missing: {missing})"
        )
    return controller
