"""``python -m megatron_rl bench routing_replay`` end to end: a bf16 hf engine with planted router noise vs the
fp32 trainer, with and without routing replay (one JSON line).

Checked: with replay the trainer uses the engine's expert set on every (forwarded token, MoE
layer); without replay and with noise it does not; replay lowers the mismatch's KL there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiproc
def test_replay_makes_routes_agree_and_lowers_the_mismatch():
    cmd = [
        sys.executable,
        "-m",
        "megatron_rl",
        "bench",
        "routing_replay",
        "--router-noise",
        "0",
        "0.1",
        "--prompts",
        "2",
        "--group-size",
        "4",
        "--max-new-tokens",
        "24",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("{")]
    rows = {(r["router_noise"], r["routing_replay"]): r for r in json.loads(line)["results"]}
    assert {k[1] for k in rows} == {"none", "rollout"} and {k[0] for k in rows} == {0.0, 0.1}
    for noise in (0.0, 0.1):
        assert rows[noise, "rollout"]["routes/agree_fraction"] == 1.0
        assert rows[noise, "rollout"]["mismatch/n_tokens"] == rows[noise, "none"]["mismatch/n_tokens"] > 0
    assert rows[0.1, "none"]["routes/agree_fraction"] < 1.0
    assert rows[0.1, "rollout"]["mismatch/kl_k3"] < rows[0.1, "none"]["mismatch/kl_k3"]
