"""``trainer.resume_from: auto``: the last complete checkpoint of ``save_dir`` (a restarted world
continues from it), skipping an interrupted (``.tmp``) or damaged save; none: a fresh start."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.config.sections import check_section
from megatron_rl.trainer.checkpoint import latest_checkpoint, resolve_resume, write_manifest


def _checkpoint(root, name, payload=b"weights"):
    path = root / name
    path.mkdir()
    (path / "model.bin").write_bytes(payload)
    write_manifest(path)
    return path


def test_auto_picks_the_last_complete_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, "step_2")
    good = _checkpoint(tmp_path, "step_10")  # numeric order, not lexical
    damaged = _checkpoint(tmp_path, "step_12")
    (damaged / "model.bin").write_bytes(b"truncated")
    (tmp_path / "step_14.tmp").mkdir()  # a save the kill interrupted
    assert latest_checkpoint(tmp_path) == good

    @dataclasses.dataclass(frozen=True)
    class Trainer:
        save_dir: str
        resume_from: str | None

    cfg = dataclasses.make_dataclass("C", [("trainer", Trainer)], frozen=True)(
        trainer=Trainer(save_dir=str(tmp_path), resume_from="auto")
    )
    assert resolve_resume(cfg).trainer.resume_from == str(good)
    fresh = dataclasses.replace(cfg, trainer=Trainer(save_dir=str(tmp_path / "none"), resume_from="auto"))
    assert resolve_resume(fresh).trainer.resume_from is None
    explicit = dataclasses.replace(cfg, trainer=Trainer(save_dir=str(tmp_path), resume_from="x/step_2"))
    assert resolve_resume(explicit) is explicit


def test_auto_needs_a_save_dir():
    from megatron_rl.config.schema import TrainerConfig

    problems = list(check_section(TrainerConfig(steps=1, resume_from="auto"), "trainer"))
    assert any(key == "trainer.resume_from" and "save_dir" in msg for key, msg in problems), problems
    assert not list(check_section(TrainerConfig(steps=1, resume_from="auto", save_dir="out"), "trainer"))


@pytest.mark.parametrize("restarts", ["0", "2"])
def test_launch_sh_passes_max_restarts(restarts):
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "MEGATRON_RL_DRY_RUN": "1", "MAX_RESTARTS": restarts, "PLATFORM": "cpu"}
    out = subprocess.run(
        ["bash", "examples/launch.sh", "examples/demo/config.yaml"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"--max-restarts {restarts} " in out


@pytest.mark.parametrize(("restarts", "ok"), [(2, True), (1, False)])
def test_launch_msrun_runs_msrun_again_up_to_max_restarts(tmp_path, restarts, ok):
    """A fake msrun failing twice, then succeeding: MAX_RESTARTS=2 gets through, 1 does not."""
    import os
    import stat
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    fake = tmp_path / "msrun"
    fake.write_text(f"#!/bin/bash\necho run >> {tmp_path}/runs\n[[ $(wc -l < {tmp_path}/runs) -ge 3 ]]\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "MAX_RESTARTS": str(restarts)}
    env.pop("MEGATRON_RL_DRY_RUN", None)
    out = subprocess.run(
        ["bash", "examples/launch_msrun.sh", "examples/demo/config.yaml"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    )
    assert (out.returncode == 0) is ok, out.stderr[-2000:]
    assert (tmp_path / "runs").read_text().count("run") == restarts + 1
    assert "msrun failed; restart 1 of" in out.stderr
