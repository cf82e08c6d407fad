"""FixedController, and `load_controller` for built-ins and a user class given by dotted path."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from megatron_rl.control import (
    FixedController,
    GroupSizeController,
    SAGCController,
    SAGCSettings,
    StepObservation,
    load_controller,
    measure_step,
)


class HalvingController:
    """Reference user controller: halves G after a straggler step, doubles it after `patience`
    clean steps in a row, within [floor, ceiling]."""

    def __init__(self, *, ceiling: int = 16, floor: int = 2, patience: int = 2, tau: float = 3.0):
        self.ceiling, self.floor, self.patience, self.tau = ceiling, floor, patience, tau
        self.g, self.clean = ceiling, 0

    def choose(self) -> int:
        return self.g

    def observe(self, response_lengths: Sequence[int]) -> StepObservation:
        obs = measure_step(response_lengths, group_size=self.g, tau=self.tau)
        self.clean = 0 if obs.straggler else self.clean + 1
        if obs.straggler:
            self.g = max(self.g // 2, self.floor)
        elif self.clean >= self.patience:
            self.g, self.clean = min(self.g * 2, self.ceiling), 0
        return obs

    def state_dict(self) -> dict[str, Any]:
        return {"g": self.g, "clean": self.clean}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.g, self.clean = state["g"], state["clean"]

    def metrics(self) -> dict[str, float]:
        return {"control/group_size": float(self.g)}


class NotAController:
    def choose(self) -> int:
        return 4


CLEAN, STRAGGLER = [10, 10, 10], [10, 10, 100]


def test_fixed_controller_counts_stragglers():
    ctrl = FixedController(8, tau=2.0)
    pattern = [1, 0, 0, 1, 1]
    for s in pattern:
        assert ctrl.choose() == 8
        ctrl.observe(STRAGGLER if s else CLEAN)
    m = ctrl.metrics()
    assert m["control/group_size"] == 8.0
    assert m["control/straggler_rate"] == pytest.approx(3 / 5)
    restored = FixedController(8, tau=2.0)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.metrics()["control/straggler_rate"] == pytest.approx(3 / 5)
    with pytest.raises(ValueError, match="group_size"):
        FixedController(4).load_state_dict(ctrl.state_dict())


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_fixed_controller_rejects_bad_group_size(bad):
    with pytest.raises(ValueError, match="group_size"):
        FixedController(bad)


def test_builtins():
    fixed = load_controller("fixed", group_size=4, settings=SAGCSettings(tau=5.0))
    assert isinstance(fixed, FixedController) and fixed.choose() == 4 and fixed.tau == 5.0
    sagc = load_controller("sagc", settings=SAGCSettings(initial=4))
    assert isinstance(sagc, SAGCController) and sagc.settings.initial == 4
    assert isinstance(sagc, GroupSizeController) and isinstance(fixed, GroupSizeController)
    with pytest.raises(ValueError, match="group_size"):
        load_controller("fixed")
    with pytest.raises(ValueError, match="options"):
        load_controller("sagc", options={"x": 1})


def test_dotted_path_loads_reference_implementation():
    ctrl = load_controller(f"{__name__}:HalvingController", options={"ceiling": 8, "floor": 2})
    assert isinstance(ctrl, HalvingController)
    seen = []
    for s in [0, 1, 1, 1, 0, 0, 0, 0, 0]:
        seen.append(ctrl.choose())
        ctrl.observe(STRAGGLER if s else CLEAN)
    # 8 (clean) 8 (straggler) -> 4 -> 2 -> 2 (floor), then two clean steps per doubling.
    assert seen == [8, 8, 4, 2, 2, 2, 4, 4, 8]


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("adaptive", "one of"),
        ("no_such_module_xyz:Thing", "cannot import"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NotAController", "does not implement"),
    ],
)
def test_bad_specs_raise(spec, match):
    with pytest.raises(ValueError, match=match):
        load_controller(spec)
