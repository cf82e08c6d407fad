"""Device strings of ``rollout.devices``: parsing, and the device set of each engine worker.

Contract: ``parse_device("cuda:0,1")`` -> ``DeviceAssignment(kind="cuda", ids=(0, 1))``; a bad
string raises ``ValueError`` naming ``where`` (the dotted key). Forms: ``"cpu"`` (no pinning),
``"cpu:1"`` / ``"cpu:0-1"`` / ``"cpu:0,2"`` (cores the worker is pinned to), ``"cuda:0"`` /
``"cuda:0,1"`` / ``"npu:3"`` (the visible devices of that worker; one per tensor-parallel rank).
The kinds are the schema's ``DeviceKind``. Lives in ``config/`` because the config's rules
parse these strings; ``rollout/`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from .schema import DeviceKind

DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)


@dataclass(frozen=True, kw_only=True)
class DeviceAssignment:
    """The device set of one worker: a kind and its ids (cores on CPU, device ordinals otherwise)."""

    kind: DeviceKind
    ids: tuple[int, ...] = ()  # empty on CPU: no pinning

    def __str__(self) -> str:
        return self.kind + (":" + ",".join(map(str, self.ids)) if self.ids else "")


def _parse_id_list(text: str, where: str) -> tuple[int, ...]:
    ids: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"{where}: bad id list {text!r} (expected e.g. '1', '0-3' or '0,2')")
        ids.extend(range(int(lo), int(hi or lo) + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{where}: id list {text!r} repeats an id")
    return tuple(ids)


def parse_device(text: str, where: str = "rollout.devices") -> DeviceAssignment:
    """``"cpu"``, ``"cpu:0-1"``, ``"cuda:0,1"``, ``"npu:2"`` -> ``DeviceAssignment``."""
    kind, sep, rest = text.strip().partition(":")
    if kind not in DEVICE_KINDS:
        raise ValueError(f"{where}: device {text!r} must start with one of {DEVICE_KINDS}")
    if kind != "cpu" and not rest:
        raise ValueError(f"{where}: device {text!r} must name its ids, e.g. '{kind}:0'")
    return DeviceAssignment(kind=kind, ids=_parse_id_list(rest, where) if sep else ())


def engine_devices(devices: Sequence[str], num_engines: int) -> tuple[DeviceAssignment, ...]:
    """One ``DeviceAssignment`` per engine: ``rollout.devices`` parsed, or unpinned CPU engines
    when it is empty (the length rule is `sections.check_rollout`'s)."""
    if not devices:
        return tuple(DeviceAssignment(kind="cpu") for _ in range(num_engines))
    return tuple(parse_device(d, f"rollout.devices[{i}]") for i, d in enumerate(devices))
