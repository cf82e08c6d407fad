"""`tools/parity.py --cp 2` as a user runs it: shared-prompt packing under CP vs transformers, one JSON line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hf_models import make_tiny_hf

pytestmark = [pytest.mark.multiproc]

ROOT = Path(__file__).resolve().parents[1]


def test_parity_cli_cp2(tmp_path):
    model = make_tiny_hf(tmp_path / "llama", "llama", tied=True)
    args = ["--model", str(model), "--cp", "2", "--seq-len", "16", "--batch", "3"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/parity.py"), *args], capture_output=True, text=True, timeout=400
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout
    result = json.loads(lines[0])
    assert (result["tp"], result["pp"], result["ep"], result["cp"]) == (1, 1, 1, 2)
    assert 0 <= result["max_abs_logit_diff"] <= 1e-5
    assert 0 <= result["max_abs_logprob_diff"] <= 1e-5
