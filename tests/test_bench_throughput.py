"""``python -m megatron_rl bench throughput`` on a tiny model: a megatron_rl run and the TRL peer run side by side,
one JSON line with each run's completion tokens/s and its ratio to TRL's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[1]


def test_bench_throughput_runs_megatron_rl_and_trl_side_by_side(tmp_path):
    pytest.importorskip("trl")
    config = tiny_rl_config(tmp_path, make_tiny_rl_model(tmp_path / "model"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "bench",
            "throughput",
            "--config",
            str(config),
            "--steps",
            "3",
            "--only",
            "sync_hf_shared-prompt,trl",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    runs = line["runs"]
    assert set(runs) == {"sync_hf_shared-prompt", "trl_grpo_trainer"}
    ours, trl = runs["sync_hf_shared-prompt"], runs["trl_grpo_trainer"]
    for r in (ours, trl):
        assert r["measured_steps"] == 2 and r["completion_tokens_per_s"] > 0 and r["s_per_step"] > 0
    assert trl["ratio_to_trl"] == 1.0
    assert ours["ratio_to_trl"] == pytest.approx(ours["completion_tokens_per_s"] / trl["completion_tokens_per_s"])
    # 3 prompts x G 4 x at most 8 new tokens per step: tokens/s cannot exceed that over the step time
    assert ours["completion_tokens_per_s"] <= 3 * 4 * 8 / ours["s_per_step"] + 1e-6
