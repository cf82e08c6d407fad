"""SAGC controller: settings validation, straggler measurement, each update against a closed form
written out here, Thompson choice against an independent redraw, and exact resume."""

from __future__ import annotations

import itertools
import json
import statistics

import numpy as np
import pytest

from megatron_rl.control import SAGCController, SAGCSettings, measure_step

CLEAN = [100, 100, 100, 100]  # max/median = 1
STRAGGLER = [100, 100, 100, 1000]  # max/median = 10


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("candidates", ()),
        ("candidates", (8, 4)),
        ("candidates", (4, 4, 8)),
        ("candidates", (0, 4)),
        ("candidates", (4.0, 8)),
        ("initial", 5),
        ("tau", 1.0),
        ("tau", float("nan")),
        ("delta", 0.0),
        ("delta", 1.0),
        ("gamma", 0.0),
        ("gamma", 1.5),
        ("eta", 0.0),
        ("lambda_max", -1.0),
        ("prior_alpha", 0.0),
        ("prior_beta", -2.0),
        ("forget_unchosen", 1),
        ("seed", -1),
    ],
)
def test_settings_reject_bad_field(field, value):
    kwargs = {field: value}
    if field == "candidates" and value:
        kwargs["initial"] = value[-1]
    key = "control.group_size" if field == "initial" else f"control.sagc.{field}"  # the config's keys
    with pytest.raises(ValueError, match=rf"{key}\b"):
        SAGCSettings(**kwargs)


def test_settings_accept_list_candidates_and_are_keyword_only():
    s = SAGCSettings(candidates=[2, 4], initial=2)
    assert s.candidates == (2, 4)
    with pytest.raises(TypeError):
        SAGCSettings((2, 4), 2)  # type: ignore[misc]


def test_measure_step_matches_statistics_median():
    lengths = [7, 3, 50, 9, 12, 4]
    obs = measure_step(lengths, group_size=2, tau=5.0)
    ratio = max(lengths) / statistics.median(lengths)  # 50 / 8
    assert obs.median_length == statistics.median(lengths)
    assert obs.straggler_ratio == pytest.approx(ratio)
    assert obs.straggler is (ratio > 5.0)
    assert measure_step(lengths, group_size=2, tau=7.0).straggler is False
    assert (obs.max_length, obs.num_responses, obs.group_size) == (50, 6, 2)


@pytest.mark.parametrize("bad", [[], [3, 0], [1.5, 2.0], [[1, 2]]])
def test_measure_step_rejects_bad_lengths(bad):
    with pytest.raises(ValueError, match="response_lengths"):
        measure_step(bad, group_size=4, tau=3.0)


def _drive(ctrl: SAGCController, pattern: list[int]) -> list[int]:
    """Run one step per entry of `pattern` (1 = straggler step); return chosen candidate indices."""
    chosen = []
    for s in pattern:
        chosen.append(ctrl.settings.candidates.index(ctrl.choose()))
        ctrl.observe(STRAGGLER if s else CLEAN)
    return chosen


@pytest.mark.parametrize("forget_unchosen", [True, False])
def test_posterior_matches_discounted_closed_form(forget_unchosen):
    gamma, pa, pb = 0.7, 0.5, 2.0
    settings = SAGCSettings(
        gamma=gamma, prior_alpha=pa, prior_beta=pb, eta=4.0, seed=3, forget_unchosen=forget_unchosen
    )
    ctrl = SAGCController(settings)
    pattern = [0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 0]
    chosen = _drive(ctrl, pattern)
    assert len(set(chosen)) >= 2, "the pattern must exercise more than one candidate"
    n = len(pattern)
    for k in range(3):
        if forget_unchosen:  # every step discounts every candidate: weight gamma^(steps after t)
            w = [gamma ** (n - 1 - t) if chosen[t] == k else 0.0 for t in range(n)]
        else:  # discounted only by later steps that chose k
            w = [gamma ** sum(c == k for c in chosen[t + 1 :]) if chosen[t] == k else 0.0 for t in range(n)]
        alpha = pa + sum(wt * s for wt, s in zip(w, pattern, strict=True))
        beta = pb + sum(wt * (1 - s) for wt, s in zip(w, pattern, strict=True))
        g = settings.candidates[k]
        m = ctrl.metrics()
        assert m[f"control/alpha/G{g}"] == pytest.approx(alpha, rel=1e-12)
        assert m[f"control/beta/G{g}"] == pytest.approx(beta, rel=1e-12)
        assert m[f"control/p_mean/G{g}"] == pytest.approx(alpha / (alpha + beta), rel=1e-12)


def test_dual_update_with_both_clips():
    ctrl = SAGCController(SAGCSettings(eta=0.5, delta=0.1, lambda_max=1.0))
    expected = [0.0, 0.45, 0.9, 1.0, 0.95, 1.0]  # 0-0.05 clips to 0; 0.9+0.45 clips to 1
    for s, lam in zip([0, 1, 1, 1, 0, 1], expected, strict=True):
        ctrl.choose()
        ctrl.observe(STRAGGLER if s else CLEAN)
        assert ctrl.lagrange_multiplier == pytest.approx(lam, abs=1e-12)
    assert ctrl.metrics()["control/lambda"] == ctrl.lagrange_multiplier


def test_no_stragglers_climbs_one_neighbour_per_step():
    ctrl = SAGCController(SAGCSettings(candidates=(2, 4, 8, 16, 32), initial=2))
    choices = []
    for _ in range(6):
        choices.append(ctrl.choose())
        ctrl.observe(CLEAN)
    assert choices == [2, 4, 8, 16, 32, 32]  # the first step runs the configured G, then one move a step


@pytest.mark.parametrize("initial", [2, 8, 32])
def test_first_choice_is_the_configured_group_size_whatever_the_draw(initial):
    for seed in range(5):
        ctrl = SAGCController(SAGCSettings(candidates=(2, 4, 8, 16, 32), initial=initial, seed=seed))
        assert ctrl.choose() == initial and ctrl.metrics()["control/group_size"] == initial


def test_persistent_stragglers_descend_one_neighbour_at_a_time():
    cands = (2, 4, 8, 16)
    ctrl = SAGCController(SAGCSettings(candidates=cands, initial=16, eta=20.0, lambda_max=50.0))
    choices = [16]
    for _ in range(40):
        choices.append(ctrl.choose())
        ctrl.observe(STRAGGLER if choices[-1] > 2 else CLEAN)
    moves = [cands.index(b) - cands.index(a) for a, b in itertools.pairwise(choices)]
    assert set(moves) <= {-1, 0, 1}
    assert -1 in moves and choices[-1] == 2, choices


def test_choice_is_argmax_over_neighbours_of_an_independent_redraw():
    settings = SAGCSettings(candidates=(2, 4, 8, 16, 32), initial=8, eta=2.0, seed=11)
    ctrl = SAGCController(settings)
    _drive(ctrl, [1, 0, 1, 1, 0, 1, 0])
    for _ in range(20):
        state = ctrl.state_dict()
        redraw = np.random.default_rng()
        redraw.bit_generator.state = state["rng"]
        m = ctrl.metrics()
        alpha = [m[f"control/alpha/G{g}"] for g in settings.candidates]
        beta = [m[f"control/beta/G{g}"] for g in settings.candidates]
        p = redraw.beta(alpha, beta)
        i = state["index"]
        window = range(max(i - 1, 0), min(i + 2, len(settings.candidates)))
        best = max(window, key=lambda k: np.log2(settings.candidates[k]) - state["lambda"] * p[k])
        g = ctrl.choose()
        assert g == settings.candidates[best]
        assert [ctrl.metrics()[f"control/p_sample/G{c}"] for c in settings.candidates] == list(p)
        ctrl.observe(STRAGGLER if g >= 8 else CLEAN)


def test_choose_is_idempotent_until_observe():
    ctrl = SAGCController(SAGCSettings(eta=3.0))
    _drive(ctrl, [1, 1, 0])
    first = ctrl.choose()
    rng_before = ctrl.state_dict()["rng"]
    assert all(ctrl.choose() == first for _ in range(5))
    assert ctrl.state_dict()["rng"] == rng_before
    ctrl.observe(CLEAN)
    with pytest.raises(RuntimeError, match="choose"):
        ctrl.observe(CLEAN)


def _lengths(step: int, g: int) -> list[int]:
    """A deterministic heavy-tailed step: depends only on (step, G), so a resumed run sees the
    same lengths as the uninterrupted one."""
    rng = np.random.default_rng([step, g])
    return (100 * rng.pareto(1.2, size=4 * g) + 50).astype(np.int64).tolist()


def _run(ctrl: SAGCController, start: int, steps: int) -> list[int]:
    out = []
    for t in range(start, start + steps):
        out.append(ctrl.choose())
        ctrl.observe(_lengths(t, out[-1]))
    return out


@pytest.mark.parametrize("pending", [False, True])
def test_state_dict_resume_reproduces_decisions(pending):
    settings = SAGCSettings(eta=1.0, gamma=0.9, seed=5)
    ctrl = SAGCController(settings)
    head = _run(ctrl, 0, 40)
    assert len(set(head)) > 1, "the workload must move the controller"
    if pending:
        ctrl.choose()
    saved = json.loads(json.dumps(ctrl.state_dict()))  # what a checkpoint round trip keeps
    tail = _run(ctrl, 40, 60)
    # A fresh controller with another seed: only the restored RNG state can make it agree.
    resumed = SAGCController(SAGCSettings(eta=1.0, gamma=0.9, seed=99))
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == saved
    assert _run(resumed, 40, 60) == tail


def test_load_state_dict_rejects_other_candidates():
    state = SAGCController(SAGCSettings()).state_dict()
    other = SAGCController(SAGCSettings(candidates=(2, 4, 8), initial=4))
    with pytest.raises(ValueError, match="candidates"):
        other.load_state_dict(state)


def test_metrics_are_flat_floats_with_decision_and_posteriors():
    ctrl = SAGCController(SAGCSettings())
    ctrl.choose()  # the first step runs the configured G without a draw
    ctrl.observe(STRAGGLER)
    g = ctrl.choose()
    ctrl.observe(STRAGGLER)
    m = ctrl.metrics()
    assert all(isinstance(v, float) for v in m.values())
    assert m["control/group_size"] == g
    assert m["control/straggler"] == 1.0 and m["control/straggler_ratio"] == 10.0
    assert m["control/straggler_rate"] == 1.0
    for c in (4, 8, 16):
        assert {f"control/{k}/G{c}" for k in ("alpha", "beta", "p_mean", "p_sample")} <= m.keys()
