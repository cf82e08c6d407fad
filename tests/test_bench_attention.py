"""``python -m megatron_rl bench attention`` on the CPU: the Triton kernel under the interpreter, tiny, checked
against the reference backend and timed against per-sample SDPA; one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.kernels]

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def report() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the tool must set it itself
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", "attention", "--device", "cpu"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_matches_the_reference_forward_and_backward(report):
    assert report["interpreted"] and report["device"] == "cpu" and report["dtype"] == "float32"
    triton = report["backends"]["triton"]
    assert triton["status"] == "ok"
    for key in ("max_err_out", "max_err_dq", "max_err_dk", "max_err_dv"):
        assert 0 <= triton[key] <= 1e-4, (key, triton[key])
    assert triton["fwd_bwd_ms"] > 0 and triton["tflops"] > 0
    assert report["backends"]["flex"]["status"].startswith("skipped")  # CPU FlexAttention: forward only


def test_useful_flops_and_baselines(report):
    """Useful FLOPs = allowed pairs of the layout's dense mask x 4·Hq·D x 3 (forward + backward)."""
    from megatron_rl.attention import AttentionLayout

    s = report["shape"]
    lens = [[max(1, s["lr"] - (i * s["lr"]) // (2 * s["k"])) for i in range(s["k"])] for _ in range(s["groups"])]
    layout = AttentionLayout.from_lengths([s["lp"]] * s["groups"], lens)
    pairs = int(layout.dense_mask().sum())
    assert report["tokens"] == layout.total_tokens
    assert report["useful_tflop"] == pytest.approx(3 * 4 * s["hq"] * s["d"] * pairs / 1e12)
    sdpa = report["baselines"]["sdpa_per_sample"]
    assert sdpa["status"] == "ok" and sdpa["fwd_bwd_ms"] > 0
    assert sdpa["tflops"] == pytest.approx(report["useful_tflop"] * 1e12 / sdpa["fwd_bwd_ms"] / 1e9)
    assert report["baselines"]["flash_attn_varlen"]["status"].startswith("skipped")
