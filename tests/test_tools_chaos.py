"""``tools/chaos.py``: worker kills and hangs, a flaky reward, a SIGTERM + resume and a SIGKILLed
trainer rank lose and duplicate nothing, and each resumed run ends where the uninterrupted one does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[1]


def test_chaos_runs_lose_nothing_and_resume_equal(tmp_path):
    """Both scenarios against one uninterrupted run (4 steps, 3 prompts x G 4):
    - stop: SIGTERM after step 2, resume from the last checkpoint;
    - rank-kill: rank 1 of a two-rank torchrun world SIGKILLed after step 2's checkpoint, torchrun
      (--max-restarts 1) restarts the world and trainer.resume_from=auto continues."""
    out = subprocess.run(
        [
            sys.executable,
            "tools/chaos.py",
            "--steps",
            "4",
            "--seed",
            "1",
            "--out",
            str(tmp_path),
            "--scenarios",
            "stop,rank-kill",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(lines[-1])
    assert out.returncode == 0, report
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["resumed_equal"] is True
    assert report["samples_trained"] == report["samples_expected"] == 2 * 4 * 3 * 4
    assert 2 <= report["stopped_at_step"] < 4 and report["steps_logged"] == [4, 4]
    assert "reward chaos:flaky_reward: raised" in out.stdout + out.stderr  # the reward guard was exercised
    assert report["rank_kill_killed"] is True and report["rank_kill_exit"] == 0
    assert report["rank_kill_lost"] == 0 and report["rank_kill_duplicates"] == 0
    assert report["rank_kill_resumed_equal"] is True and 2 <= report["rank_kill_resumed_at"] <= 4
    assert report["rank_kill_samples_trained"] == 4 * 3 * 4 and report["rank_kill_steps_logged"] == 4
