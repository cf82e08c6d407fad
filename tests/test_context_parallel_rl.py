"""An RL run at CP 2 equals the CP 1 run step for step (tiny model, real hf engine, emulated NPU).

Subject: ``train`` with ``parallel.cp=2`` (2 ranks, one replica: every packed micro-batch split
per-segment zigzag over the two ranks, K / V all-gathered, log-probs gathered, gradients reduced
over CP by megatron's DDP). Reference: the same config at CP 1 on one rank. Both sample with
seeded sampling in sync mode, 2 mini-batches per batch; the loss metrics of every step (world
sums: counted once per replica) and the weights after each of the 2 steps must agree, and the
weights must have moved. Checkpoints resume across CP layouts both ways (CP 1 -> CP 2 with the
distributed optimizer, CP 2 with it -> CP 1 without). Every other loss kind (bnpo, dapo, dr_grpo,
decoupled PPO with the log-linear proximal, distillation), with the KL-to-reference and entropy
terms on, ends one step at CP 2 where it does at CP 1.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.rl_fixtures import load_weights, make_tiny_rl_model, tiny_rl_config, train_recorded

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

COMMON = ["pipeline.mode=sync", "trainer.save_every=1", "trainer.mini_batches=2", "trainer.steps=2"]
TOL = 1e-5


def _run(tmp, config, name, world, overrides):
    out = tmp / name
    ranks = run_distributed(
        train_recorded, world, config, [*COMMON, *overrides, f"trainer.save_dir={out}"], timeout_s=900
    )
    history, _ = ranks[0]
    return out, history


def _max_diff(a_dir, b_dir) -> float:
    a, b = load_weights(a_dir / "model"), load_weights(b_dir / "model")
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(tmp, config, (save dir, history) of the CP 1 run)."""
    tmp = tmp_path_factory.mktemp("rl_cp")
    model = make_tiny_rl_model(tmp / "model")
    config = str(
        tiny_rl_config(
            tmp,
            model,
            reward={"fn": "tests.rl_fixtures:digit_share_reward"},
            data={"max_prompt_tokens": 128},
            trainer={"steps": 2, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
        )
    )
    return tmp, config, _run(tmp, config, "cp1", 1, [])


VARIANTS = {  # name: overrides of the 2-rank run
    "cp2": ["parallel.cp=2"],
    "cp2_distributed_optimizer": ["parallel.cp=2", "parallel.distributed_optimizer=true"],
}


@pytest.fixture(scope="module")
def cp2_runs(reference):
    """variant -> (save dir, history) of its 2-rank run, each run once per module."""
    tmp_path, config, _ = reference
    done = {}

    def get(variant):
        if variant not in done:
            done[variant] = _run(tmp_path, config, variant, 2, VARIANTS[variant])
        return done[variant]

    return get


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cp2_run_equals_cp1_run(reference, cp2_runs, variant):
    tmp_path, config, (ref_dir, ref_hist) = reference
    out, history = cp2_runs(variant)
    assert _max_diff(tmp_path, ref_dir / "step_2") > 1e-3, "training did not move the weights"
    for step in (1, 2):
        diff = _max_diff(ref_dir / f"step_{step}", out / f"step_{step}")
        assert diff <= TOL, f"step {step}: weights differ from the CP 1 run by {diff:.2e}"
    assert len(history) == len(ref_hist) == 2
    for step, (h, ref) in enumerate(zip(history, ref_hist, strict=True), start=1):
        keys = sorted(k for k in ref if k.startswith(("loss/", "mismatch/")))
        assert "loss/value" in keys and "loss/n_tokens" in keys, keys
        for key in keys:
            assert h.get(key) == pytest.approx(ref[key], rel=1e-4, abs=1e-6), f"step {step}: {key}"
        assert h["train/responses"] == ref["train/responses"]


def test_resume_across_cp_layouts(reference):
    """The CP 1 run's step-1 checkpoint (weights, Adam state, prompt stream) resumed at CP 2 with
    the distributed optimizer (state sharded over DP x CP) ends step 2 where the CP 1 run does."""
    tmp_path, config, (ref_dir, _) = reference
    resume = [*VARIANTS["cp2_distributed_optimizer"], f"trainer.resume_from={ref_dir / 'step_1'}"]
    out, history = _run(tmp_path, config, "resumed_cp2", 2, resume)
    assert len(history) == 1
    diff = _max_diff(ref_dir / "step_2", out / "step_2")
    assert diff <= TOL, f"step 2 after resuming at CP 2: weights differ from the CP 1 run by {diff:.2e}"


def test_resume_from_cp2_at_cp1(reference, cp2_runs):
    """The other way: the CP 2 run's step-1 checkpoint (saved with the Adam state sharded over
    DP x CP by the distributed optimizer) resumed on one rank at CP 1 without it ends step 2
    where the CP 1 run does."""
    tmp_path, config, (ref_dir, _) = reference
    cp2_dir, _ = cp2_runs("cp2_distributed_optimizer")
    out, history = _run(tmp_path, config, "resumed_cp1", 1, [f"trainer.resume_from={cp2_dir / 'step_1'}"])
    assert len(history) == 1
    diff = _max_diff(ref_dir / "step_2", out / "step_2")
    assert diff <= TOL, f"step 2 after resuming the CP 2 checkpoint at CP 1: weights differ by {diff:.2e}"


LOSSES = {  # every algorithm.loss besides grpo (the runs above), with the KL and entropy terms on
    "bnpo": [],
    "dapo": [],
    "dr_grpo": [],
    "ppo_decoupled": ["algorithm.proximal=loglinear"],
    "distill": ["distill.coef=0.5"],  # the teacher: the starting checkpoint itself
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_every_loss_at_cp2_equals_cp1(reference, loss):
    """One step of each loss kind at CP 2 ends with the weights (and loss metrics) of CP 1."""
    tmp_path, config, _ = reference
    terms = ["algorithm.kl.coef=0.05", "algorithm.entropy_coef=0.01", "trainer.steps=1"]
    teacher = [f"distill.teacher={tmp_path / 'model'}"] if loss == "distill" else []
    overrides = [f"algorithm.loss={loss}", *terms, *teacher, *LOSSES[loss]]
    ref_dir, ref_hist = _run(tmp_path, config, f"{loss}_cp1", 1, overrides)
    out, history = _run(tmp_path, config, f"{loss}_cp2", 2, [*overrides, "parallel.cp=2"])
    assert _max_diff(tmp_path, ref_dir / "step_1") > 1e-4, "training did not move the weights"
    diff = _max_diff(ref_dir / "step_1", out / "step_1")
    assert diff <= TOL, f"{loss}: weights differ from the CP 1 run by {diff:.2e}"
    keys = sorted(k for k in ref_hist[0] if k.startswith("loss/") or k in ("distill/kl", "distill/tokens"))
    for key in keys:
        assert history[0].get(key) == pytest.approx(ref_hist[0][key], rel=1e-4, abs=1e-6), f"{loss}: {key}"
