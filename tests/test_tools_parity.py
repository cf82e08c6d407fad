"""`tools/parity.py` as a user runs it: starts its own ranks, prints one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]


def test_parity_cli_tp2(tmp_path):
    model = make_tiny_hf(tmp_path / "llama", "llama", tied=True)
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/parity.py"),
            "--model",
            str(model),
            "--tp",
            "2",
            "--pp",
            "1",
            "--seq-len",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert result["tp"] == 2 and result["pp"] == 1
    assert 0 <= result["max_abs_logit_diff"] <= 1e-4
    assert 0 <= result["max_abs_logprob_diff"] <= 1e-4


def test_parity_cli_rejects_impossible_tp(tmp_path):
    model = make_tiny_hf(tmp_path / "qwen2", "qwen2", layers=2)
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/parity.py"), "--model", str(model), "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert "tp 3 does not divide num_attention_heads (4), num_key_value_heads (2)" in out.stderr
    assert "valid tp: [1, 2]" in out.stderr


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_parity_cli_lora_against_peft(tmp_path, tp, pp):
    """--lora-rank: the same random adapters on peft's HF model and ours; logits and every
    adapter gradient agree (fp32) and the line keeps the plain keys."""
    model = make_tiny_hf(tmp_path / "qwen2", "qwen2")
    args = ["--model", str(model), "--tp", str(tp), "--pp", str(pp), "--seq-len", "16", "--lora-rank", "4"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/parity.py"), *args], capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert (result["tp"], result["pp"], result["lora_rank"]) == (tp, pp, 4)
    assert 0 <= result["max_abs_logit_diff"] <= 1e-4
    assert 0 <= result["max_rel_logit_err"] <= 1e-5
    assert 0 < result["max_rel_adapter_grad_err"] <= 1e-5
