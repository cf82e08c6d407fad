"""``tools/chaos.py``: worker kills and hangs, a flaky reward and a SIGTERM + resume lose and
duplicate nothing, and the resumed run ends where the uninterrupted one does."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[1]


def test_chaos_run_loses_nothing_and_resumes_equal(tmp_path):
    out = subprocess.run([sys.executable, "tools/chaos.py", "--steps", "4", "--seed", "1", "--out", str(tmp_path),
                          "--scenarios", "stop"],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(lines[-1])
    assert out.returncode == 0, report
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["resumed_equal"] is True
    assert report["samples_trained"] == report["samples_expected"] == 2 * 4 * 3 * 4
    assert 2 <= report["stopped_at_step"] < 4 and report["steps_logged"] == [4, 4]
    assert "reward chaos:flaky_reward: raised" in out.stdout + out.stderr  # the reward guard was exercised


def test_a_killed_trainer_rank_restarts_the_world_and_resumes_equal(tmp_path):
    """Rank 1 of a two-rank torchrun world SIGKILLed after step 2's checkpoint: torchrun
    (--max-restarts 1) restarts the world, trainer.resume_from=auto continues from the last
    complete checkpoint; nothing lost or duplicated, weights equal the uninterrupted run's."""
    out = subprocess.run([sys.executable, "tools/chaos.py", "--steps", "3", "--seed", "1", "--out", str(tmp_path),
                          "--scenarios", "rank-kill"], cwd=REPO, capture_output=True, text=True, timeout=1200)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, out.stdout[-2000:] + out.stderr[-3000:]
    report = json.loads(lines[-1])
    assert out.returncode == 0, report
    assert report["rank_kill_killed"] is True and report["rank_kill_exit"] == 0
    assert report["rank_kill_lost"] == 0 and report["rank_kill_duplicates"] == 0
    assert report["rank_kill_resumed_equal"] is True and 2 <= report["rank_kill_resumed_at"] <= 3
    assert report["rank_kill_samples_trained"] == 3 * 3 * 4 and report["rank_kill_steps_logged"] == 3
