"""`python -m megatron_rl bench weight_sync` as a user runs it, tiny: one JSON line with every sync path's
seconds, GB/s and CPU seconds, and the bucketed big-model transfer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]


def test_bench_weight_sync_prints_every_path(tmp_path):
    model = make_tiny_hf(tmp_path / "qwen2", "qwen2", layers=2)
    args = ["--model", str(model), "--engines", "hf", "--syncs", "2", "--big", "tiny", "--bucket-mb", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", "weight_sync", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    model_gb = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9
    for path in ("snapshot", "broadcast", "shared_memory"):
        timing = result["demo"]["hf"][path]
        assert timing["s"] > 0 and timing["cpu_s"] >= 0
        assert abs(timing["gb"] - model_gb) < 1e-3
        assert timing["gb_per_s"] > 0 and timing["best_s"] <= timing["s"]
    big = result["big"]
    assert big["shape"] == "tiny" and big["s"] > 0 and len(big["all_s"]) == 2
