"""The simulated workload, the wall-clock accounting, and the SAGC proof: on heavy-tailed lengths
SAGC keeps its straggler rate within delta + 0.05 and beats fixed G=16 on wall-clock; without
stragglers it settles on the largest G. Also runs tools/simulate_sagc.py --workload synthetic.
The paper workload (control/workload.py) is tested in test_control_workload.py."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.control import FixedController, SAGCSettings
from megatron_rl.control.simulation import (
    CostModel,
    LengthModel,
    compare_policies,
    simulate,
)

ROOT = Path(__file__).resolve().parents[1]


def test_tail_probability_grows_with_g_and_time_then_plateaus():
    m = LengthModel(tail_prob=1e-3, tail_group_exponent=2.0, tail_growth=3.0, ramp_steps=100)
    assert m.tail_probability(group_size=4, step=0) == pytest.approx(1e-3)
    assert m.tail_probability(group_size=8, step=0) == pytest.approx(4e-3)  # (8/4)^2
    assert m.tail_probability(group_size=4, step=50) == pytest.approx(2.5e-3)  # 1 + 3 * 0.5
    assert m.tail_probability(group_size=4, step=100) == pytest.approx(4e-3)
    assert m.tail_probability(group_size=4, step=10_000) == pytest.approx(4e-3)


def test_sample_shape_range_and_tail_frequency():
    m = LengthModel(tail_prob=1e-3, ramp_steps=10)  # q(16, 10) ~ 0.04
    rng = np.random.default_rng(0)
    x = np.concatenate([m.sample(rng, group_size=16, prompts=64, step=10) for _ in range(20)])
    assert x.dtype == np.int64 and x.min() >= 1 and x.max() <= m.max_length
    q = m.tail_probability(group_size=16, step=10)
    runaway = np.mean(x >= m.tail_scale * m.median_length)  # the body never gets that long
    assert runaway == pytest.approx(q, abs=5 * np.sqrt(q * (1 - q) / x.size))
    assert np.median(x) == pytest.approx(m.median_length, rel=0.05)


def test_without_tail_no_step_straggles():
    m = LengthModel(tail_prob=0.0)
    rng = np.random.default_rng(1)
    steps = [m.sample(rng, group_size=16, prompts=8, step=t) for t in range(300)]
    assert max(x.max() / np.median(x) for x in steps) < 3.0


def test_wall_clock_accounting_by_hand():
    lengths = LengthModel(tail_prob=0.05)
    cost = CostModel(seconds_per_token=0.01, step_overhead_s=7.0)
    result = simulate(
        FixedController(4),
        steps=6,
        prompts=3,
        work_samples=1000,
        lengths=lengths,
        cost=cost,
        rng=np.random.default_rng(7),
    )
    rng = np.random.default_rng(7)
    draws = [lengths.sample(rng, group_size=4, prompts=3, step=t) for t in range(6)]
    seconds = sum(7.0 + 0.01 * d.max() for d in draws)
    assert result.wall_clock_h == pytest.approx(seconds / (6 * 12) * 1000 / 3600)
    hits = [d.max() / np.median(d) > 3.0 for d in draws]
    assert result.straggler_rate == pytest.approx(np.mean(hits))
    assert (result.mean_g, result.final_g) == (4.0, 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_sagc_meets_the_proof_on_heavy_tailed_lengths(seed):
    delta = 0.1
    res = compare_policies(
        settings=SAGCSettings(delta=delta, seed=seed),
        steps=2000,
        prompts=8,
        seed=seed,
        lengths=LengthModel(),
        cost=CostModel(),
    )
    sagc = res["sagc"]
    assert res["fixed_16"].straggler_rate > 0.5, "premise: fixed G=16 straggles often"
    assert res["fixed_4"].straggler_rate < delta, "premise: the constraint is feasible"
    assert sagc.straggler_rate <= delta + 0.05
    assert sagc.wall_clock_h < res["fixed_16"].wall_clock_h
    assert 4 < sagc.mean_g < 16


def test_sagc_settles_on_largest_g_without_stragglers():
    res = compare_policies(
        settings=SAGCSettings(initial=4),
        steps=300,
        prompts=8,
        seed=0,
        lengths=dataclasses.replace(LengthModel(), tail_prob=0.0),
        cost=CostModel(),
    )
    sagc = res["sagc"]
    assert sagc.straggler_rate == 0.0
    assert sagc.final_g == 16 and sagc.late_mean_g == 16.0


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--no-stragglers"]])
def test_cli_prints_one_json_line(extra):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "simulate_sagc.py"),
            "--workload",
            "synthetic",
            "--steps",
            "1500",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stderr
    assert len(lines) == 1
    report = json.loads(lines[0])
    assert set(report) >= {"sagc", "fixed_4", "fixed_8", "fixed_16", "delta", "checks"}
    assert {"straggler_rate", "wall_clock_h", "mean_g", "final_g"} <= set(report["sagc"])
    assert report["checks"] and all(report["checks"].values())
    if extra:
        assert report["sagc"]["final_g"] == 16
