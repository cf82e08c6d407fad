"""The paper-workload simulator's building blocks, pinned against hand computations: the
informative-group probability, the Beta moments, the signal weights, the decode finishing times,
sync and periodic step times of a tiny hand-made length set, the length model, the calibration
premises, and tools/simulate_sagc.py's paper report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.control import SAGCSettings
from megatron_rl.control import workload as wl
from megatron_rl.control.signal import PassRateModel, beta_moment, informative_probability
from megatron_rl.control.steptime import StepTimeModel

ROOT = Path(__file__).resolve().parents[1]


def test_informative_probability_by_hand():
    assert informative_probability(2, 0.5) == pytest.approx(0.5)  # HT, TH of 4 outcomes
    assert informative_probability(4, 0.25) == pytest.approx(1 - 1 / 256 - 81 / 256)
    assert informative_probability(8, 0.0) == 0.0 and informative_probability(8, 1.0) == 0.0
    assert informative_probability(1, 0.3) == pytest.approx(0.0)  # one sample never differs


def test_beta_moments_match_the_gamma_function_formula():
    # E[p^n] = B(a + n, b) / B(a, b), written with lgamma: independent of the product formula
    a, b = 0.8, 1.2
    for n in (1, 4, 16):
        log_ratio = math.lgamma(a + n) + math.lgamma(a + b) - math.lgamma(a) - math.lgamma(a + b + n)
        assert beta_moment(a, b, n) == pytest.approx(math.exp(log_ratio), rel=1e-12)


def test_uniform_pass_rates_informative_fraction_is_g_minus_1_over_g_plus_1():
    # p ~ U(0, 1): E[p^G] = 1 / (G + 1), so I(G) = 1 - 2 / (G + 1) = (G - 1) / (G + 1)
    uniform = PassRateModel(mean=0.5, concentration=2.0)
    for g in (2, 4, 8, 16):
        assert uniform.informative_fraction(g) == pytest.approx((g - 1) / (g + 1))
    assert uniform.step_signal(4, 10, "groups") == pytest.approx(10 * 0.6)
    assert uniform.step_signal(4, 10, "log2") == pytest.approx(10 * 0.6 * 2)
    assert uniform.step_signal(4, 10, "samples") == pytest.approx(10 * 0.6 * 4)


def test_informative_fraction_monte_carlo():
    m = PassRateModel(mean=0.4, concentration=2.0)
    p = np.random.default_rng(0).beta(m.alpha, m.beta, 400_000)
    mc = np.mean(1 - p**8 - (1 - p) ** 8)
    assert m.informative_fraction(8) == pytest.approx(mc, abs=3e-3)


# Two prompts, G = 2: lengths [[1, 3], [2, 2]]. Decode iterations with a = 1, b = 0.5:
# k = 1: 4 running -> 1 + 2 = 3; k = 2: 3 running -> 2.5; k = 3: 1 running -> 1.5.
# Finished: L = 1 at 3, L = 2 at 5.5, L = 3 at 7 (T_gen = 7).
LENGTHS = np.array([[1, 3], [2, 2]])


def _model(train_token_s: float) -> StepTimeModel:
    return StepTimeModel(decode_iter_s=1.0, decode_seq_s=0.5, train_token_s=train_token_s, sync_s=2.0, prompt_tokens=1)


def test_finish_times_by_hand():
    np.testing.assert_allclose(_model(0.1).finish_times(LENGTHS), [[3.0, 7.0], [5.5, 5.5]])
    assert _model(0.1).generation_seconds(LENGTHS) == pytest.approx(7.0)


def test_sync_step_by_hand():
    # each group trains 2 prompt copies + 4 response tokens = 6 tokens
    assert _model(0.1).sync_step_seconds(LENGTHS) == pytest.approx(7.0 + 2 * 0.6 + 2.0)
    assert _model(2.0).sync_step_seconds(LENGTHS) == pytest.approx(7.0 + 2 * 12.0 + 2.0)


def test_periodic_step_by_hand():
    # group 1 finishes at 5.5, group 0 at 7: trainer 5.5 -> 6.1, then waits, 7 -> 7.6, + sync 2
    assert _model(0.1).periodic_step_seconds(LENGTHS) == pytest.approx(9.6)
    # slow trainer: 5.5 -> 17.5, then group 0 (ready at 7) 17.5 -> 29.5, + sync 2
    assert _model(2.0).periodic_step_seconds(LENGTHS) == pytest.approx(31.5)


def test_length_model_median_range_and_ramp():
    m = wl.ReasoningLengths(median_start=400, median_end=800, ramp_steps=100, max_length=4096)
    assert (m.median(0), m.median(50), m.median(100), m.median(1000)) == (400, 600, 800, 800)
    x = np.concatenate([m.sample(np.random.default_rng(s), group_size=16, prompts=32, step=0) for s in range(20)])
    assert x.shape == (640, 16) and x.dtype == np.int64
    assert 1 <= x.min() and x.max() <= 4096
    assert np.median(x) == pytest.approx(400, rel=0.05)  # log-lengths are centred at log median


def test_calibration_premises_and_independence_bound():
    work = wl.Workload(steps=300)
    rng = np.random.default_rng(3)

    def rate(g: int) -> float:
        steps = [work.lengths.sample(rng, group_size=g, prompts=work.prompts, step=t) for t in range(work.steps)]
        return float(np.mean([x.max() / np.median(x) > 3.0 for x in steps]))

    r16, r4 = rate(16), rate(4)
    assert r16 >= 0.98  # calibrated to the paper's 99.6 %
    assert r4 >= 1 - (1 - 0.996) ** 0.25 - 0.08  # the independence bound, minus sampling noise


def test_compare_on_workload_calibration_modes_and_signal():
    work = wl.Workload(steps=60, lengths=wl.ReasoningLengths(ramp_steps=60))
    res = wl.compare_on_workload(SAGCSettings(), work, seed=0)
    assert res["sync"]["fixed_16"].wall_clock_h == pytest.approx(wl.PAPER_FIXED_G16_HOURS)
    for name, sync in res["sync"].items():
        periodic = res["periodic"][name]
        assert periodic.wall_clock_h <= sync.wall_clock_h  # overlap never makes a step longer
        assert periodic.straggler_rate == sync.straggler_rate  # same lengths, same decisions
    f4 = res["sync"]["fixed_4"]
    expected = 60 * 32 * work.pass_rates.informative_fraction(4) * 2  # steps x prompts x I x log2 4
    assert f4.signal_total == pytest.approx(expected)
    assert f4.signal_per_h == pytest.approx(expected / f4.wall_clock_h)
    assert f4.samples == 60 * 32 * 4


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", "table"])
def test_cli_paper_workload(fmt):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "simulate_sagc.py"), "--steps", "40", "--format", fmt],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    if fmt == "table":
        assert "[sync]" in proc.stdout and "[periodic]" in proc.stdout
        assert "fixed_16" in proc.stdout and "paper" in proc.stdout
        return
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    report = json.loads(lines[0])
    for mode in ("sync", "periodic"):
        assert set(report[mode]) == {"sagc", "fixed_4", "fixed_8", "fixed_16"}
        assert {"wall_clock_h", "straggler_rate", "signal_per_h"} <= set(report[mode]["sagc"])
    assert report["paper"]["sagc_hours"] == 16.0
    assert report["vs_paper"]["min_g4_straggler_rate_if_independent"] == pytest.approx(0.7485, abs=1e-3)


@pytest.mark.slow
def test_cli_compares_real_runs_over_the_same_samples(tmp_path):
    keys = ("train/responses", "control/group_size", "control/straggler", "rollout/reward_mean", "time/step_s")

    def write(name, rows, steps=None):
        d = tmp_path / name
        d.mkdir()
        lines = [
            {
                "step": t + 1,
                **dict(zip(keys, r, strict=True)),
                "rollout/response_tokens": 10 * r[0],
                "time/generation_s": r[4] / 2,
            }
            for t, r in enumerate(rows)
        ]
        for line, step in zip(lines, steps or [], strict=False):
            line["step"] = step
        (d / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        return str(d)

    def cli(*dirs):
        return subprocess.run(
            [sys.executable, str(ROOT / "tools" / "simulate_sagc.py"), "--runs", *dirs],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            check=False,
        )

    sagc = write("sagc", [(32, 4, 0, 0.2, 1.0), (64, 8, 1, 0.4, 2.0), (128, 16, 1, 0.6, 6.0)])  # 224 samples
    fixed = write(
        "fixed",
        [
            (64, 8, 1, 0.3, 2.0),
            (64, 8, 1, 0.3, 2.0),
            (64, 8, 0, 0.5, 2.0),
            (64, 8, 0, 0.5, 2.0),
            (64, 8, 0, 0.9, 2.0),
            (64, 8, 0, 0.9, 2.0),
        ],
    )
    proc = cli(sagc, fixed)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["samples_budget"] == 224
    assert report[sagc] == pytest.approx(
        {
            "steps": 3,
            "samples": 224,
            "response_tokens": 2240,
            "straggler_rate": 2 / 3,
            "mean_g": 28 / 3,
            "reward_mean": 0.4,
            "reward_first5": 0.4,
            "reward_last5": 0.4,
            "step_s": 3.0,
            "generation_s": 1.5,
        },
        abs=1e-4,
    )
    # 64 + 64 + 64 = 192 <= 224 < 256: three whole steps
    assert report[fixed] == pytest.approx(
        {
            "steps": 3,
            "samples": 192,
            "response_tokens": 1920,
            "straggler_rate": 2 / 3,
            "mean_g": 8.0,
            "reward_mean": 1.1 / 3,
            "reward_first5": 1.1 / 3,
            "reward_last5": 1.1 / 3,
            "step_s": 2.0,
            "generation_s": 1.0,
        },
        abs=1e-4,
    )
    # a log_dir written twice (metrics.jsonl is appended to) is refused, not counted as one longer run
    twice = write("twice", [(64, 8, 1, 0.3, 2.0)] * 4, steps=[1, 2, 1, 2])
    proc = cli(sagc, twice)
    assert proc.returncode == 2 and "twice/metrics.jsonl" in proc.stderr and "do not increase" in proc.stderr
