"""Faults the training loop must survive: SIGTERM / SIGINT on any rank stop every rank after the
current step with a complete checkpoint, from which a resumed run ends exactly where an
uninterrupted one does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.rollout.engine_wrapper import EngineWrapper
from tests.distributed import run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, load_weights, make_tiny_rl_model, tiny_rl_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        pipeline={"mode": "sync"},
        trainer={"steps": 5, "prompts_per_batch": 3, "lr": 1e-2, "adam_eps": 1e-3},
    )
    return tmp, str(config)


def _cli(config, *overrides):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "megatron_rl", "train", config, *overrides, "--platform", TRAIN_PLATFORM]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def straight(setup):
    """The uninterrupted 5-step run's final weights (one run for both signals)."""
    tmp, config = setup
    full = _cli(config, f"trainer.save_dir={tmp / 'straight'}")
    out, _ = full.communicate(timeout=300)
    assert full.returncode == 0, out[-3000:]
    return load_weights(tmp / "straight" / "step_5" / "model")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint_that_resumes_exactly(setup, straight, sig):
    tmp, config = setup
    stopped = tmp / f"stopped_{sig.name}"
    proc = _cli(config, f"trainer.save_dir={stopped}")
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1:"):
            proc.send_signal(sig)
    assert proc.wait(timeout=300) == 0, "".join(lines[-30:])
    done = sorted(int(p.name.split("_")[1]) for p in stopped.glob("step_*") if not p.name.endswith(".tmp"))
    assert len(done) == 1 and 2 <= done[0] < 5, (done, "".join(lines[-30:]))  # stopped early, one checkpoint
    assert not list(stopped.glob("*.tmp")) and (stopped / f"step_{done[0]}" / "trainer_state.json").is_file()
    assert any(sig.name in line for line in lines)
    resume = _cli(config, f"trainer.save_dir={stopped}", f"trainer.resume_from={stopped / f'step_{done[0]}'}")
    out, _ = resume.communicate(timeout=300)
    assert resume.returncode == 0, out[-3000:]
    got = load_weights(stopped / "step_5" / "model")
    for key, value in straight.items():
        assert torch_rel(got[key], value) <= 1e-6, key


def torch_rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _signal_follower(config_path: str, overrides: list[str], metrics: str):
    """Rank 1 (a follower at TP=2) signals itself once the leader has logged two steps; the leader
    is not signalled."""
    import threading

    import torch.distributed as dist

    from megatron_rl.config import load_config
    from megatron_rl.trainer.loop import train

    def signal_after_two_steps():
        path = Path(metrics)
        while not (path.is_file() and path.read_text().count("\n") >= 2):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    if int(os.environ["RANK"]) == 1:
        threading.Thread(target=signal_after_two_steps, daemon=True).start()
    history = train(load_config(config_path, overrides), platform=TRAIN_PLATFORM)
    assert dist.is_initialized()
    return len(history)


def test_sigterm_on_one_follower_rank_stops_every_rank_together(setup):
    tmp, config = setup
    out, logs = tmp / "follower_signal", tmp / "follower_signal_logs"
    steps, _ = run_distributed(
        _signal_follower,
        2,
        config,
        ["parallel.tp=2", "trainer.steps=200", f"trainer.save_dir={out}", f"trainer.log_dir={logs}"],
        str(logs / "metrics.jsonl"),
        timeout_s=600,
    )
    assert 2 <= steps < 200, "the run did not stop early"
    assert [p.name for p in out.iterdir()] == [f"step_{steps}"]
    assert (out / f"step_{steps}" / "trainer_state.json").is_file()


class _NaNEngine(EngineWrapper):
    """A real engine whose behaviour log-probs are NaN for the steps in ``nan_steps``."""

    def __init__(self, inner, nan_steps) -> None:
        super().__init__(inner)
        self.nan_steps = set(nan_steps)

    def generate(self, requests):
        import dataclasses

        for r in self.inner.generate(requests):
            if int(r.request_id.split("/")[0]) in self.nan_steps:
                r = dataclasses.replace(r, logprobs=tuple(float("nan") for _ in r.logprobs))
            yield r


def _nan_loss_where_the_engine_gave_nan() -> None:
    """Make the loss NaN on micro-batches whose behaviour log-probs are (the loss itself drops NaN
    behaviour tokens, ``algorithms.correction``): a NaN loss as an overflow or a broken kernel gives."""
    import dataclasses

    import torch

    from megatron_rl.trainer import policy_step

    real = policy_step.policy_loss

    def policy_loss(settings, **kw):
        out = real(settings, **kw)
        if bool((kw["mask"].bool() & ~torch.isfinite(kw["behav_logp"])).any()):
            out = dataclasses.replace(out, loss=out.loss * float("nan"))
        return out

    policy_step.policy_loss = policy_loss


def _train_with_nans(config_path: str, overrides: list[str], nan_steps: list[int]):
    from megatron_rl.config import load_config
    from megatron_rl.rollout import build_engine
    from megatron_rl.trainer.loop import train

    _nan_loss_where_the_engine_gave_nan()
    cfg = load_config(config_path, overrides)
    try:
        return train(cfg, platform=TRAIN_PLATFORM, engine_factory=lambda s: _NaNEngine(build_engine(s), nan_steps))
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"


NAN_LOSS = ["algorithm.loss=ppo_decoupled", "algorithm.proximal=loglinear"]  # behaviour log-probs enter the loss


def test_a_non_finite_step_is_skipped_on_every_rank_and_counted(setup):
    tmp, config = setup
    out = tmp / "nan_once"
    history, _ = run_distributed(
        _train_with_nans,
        2,
        config,
        [*NAN_LOSS, "parallel.tp=2", "trainer.steps=3", f"trainer.save_dir={out}", "trainer.save_every=1"],
        [1],
        timeout_s=600,
    )
    assert [h["train/nonfinite_steps"] for h in history] == [0.0, 1.0, 0.0]
    assert [h["train/optimizer_steps"] for h in history] == [1.0, 0.0, 1.0]
    before, after = load_weights(out / "step_1" / "model"), load_weights(out / "step_2" / "model")
    assert all(bool((before[k] == after[k]).all()) for k in before), "a skipped step changed the weights"
    final = load_weights(out / "step_3" / "model")
    assert all(bool(v.isfinite().all()) for v in final.values())
    assert any(not bool((final[k] == after[k]).all()) for k in final), "training did not resume after the skip"


def test_non_finite_steps_in_a_row_stop_the_run_with_a_clear_error(setup):
    tmp, config = setup
    out = tmp / "nan_always"
    overrides = [*NAN_LOSS, "trainer.steps=5", "trainer.max_nonfinite_steps=2", f"trainer.save_dir={out}"]
    (result,) = run_distributed(_train_with_nans, 1, config, overrides, [0, 1, 2, 3, 4], timeout_s=600)
    assert isinstance(result, str) and result.startswith("NonFiniteError") and "max_nonfinite_steps=2" in result
    assert "step 1:" in result and not (out.exists() and list(out.iterdir()))


class _BrokenEngine(EngineWrapper):
    """Fails for good (as after too many worker restarts) when asked for step ``broken_step``."""

    def __init__(self, inner, broken_step: int) -> None:
        super().__init__(inner)
        self.broken_step = broken_step

    def generate(self, requests):
        from megatron_rl.rollout import RolloutWorkerError

        if int(requests[0].request_id.split("/")[0]) == self.broken_step:
            raise RolloutWorkerError("rollout workers died 4 times during one generate call (injected)")
        yield from self.inner.generate(requests)


def _train_until_the_engine_breaks(config_path: str, overrides: list[str]):
    from megatron_rl.config import load_config
    from megatron_rl.pipeline import PipelineError
    from megatron_rl.rollout import build_engine
    from megatron_rl.trainer.loop import train

    try:
        train(
            load_config(config_path, overrides),
            platform=TRAIN_PLATFORM,
            engine_factory=lambda s: _BrokenEngine(build_engine(s), broken_step=2),
        )
    except PipelineError as err:
        return f"{type(err.__cause__).__name__}: {err.__cause__}"
    return "no error"


def test_an_engine_that_fails_for_good_stops_the_run_after_checkpointing_the_last_step(setup):
    tmp, config = setup
    out = tmp / "engine_broken"
    (result,) = run_distributed(_train_until_the_engine_breaks, 1, config, [f"trainer.save_dir={out}"], timeout_s=600)
    assert result.startswith("RolloutWorkerError") and "died 4 times" in result
    assert sorted(p.name for p in out.iterdir()) == ["step_2"]  # the two completed steps, nothing partial
    resume = [f"trainer.save_dir={out}", f"trainer.resume_from={out / 'step_2'}"]
    (history,) = run_distributed(_train_with_nans, 1, config, resume, [], timeout_s=600)
    assert [h["train/version"] for h in history] == [3.0, 4.0, 5.0]  # resumed after 2 steps: versions keep counting
