"""Data-parallel RL runs and checkpoints that resume on another layout (issue 11).

Reference: one DP = 1, TP = 1 run of 3 steps (sync, 2 mini-batches). Every other run trains
the same batches (one dispatcher on rank 0: same prompts, same seeded samples) split over the
DP replicas by tokens, and must end with the same weights (≤ 1e-5): DP = 2 and TP = 2 × DP = 2
in sync and periodic mode (DP = 2 sync as a 2-node run: two torchrun invocations on
localhost), and runs
resumed from a step-2 checkpoint written at another layout (TP 2 × DP 2 -> TP 1 × DP 1 and
back, there with the distributed optimizer), which also needs the Adam state
resharded exactly: the optimizer files written after step 3 must hold the reference's state.
In periodic mode every behaviour log-prob the engine reported for batch t is checked against
a transformers forward of θ_t (exactly on-policy at DP > 1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import free_port, run_distributed
from tests.rl_fixtures import TRAIN_PLATFORM, load_weights, make_tiny_rl_model, tiny_rl_config, train_recorded
from tests.test_rl_loop import assert_engine_sampled_from_trained_weights

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

TOL = 1e-5
COMMON = ["trainer.save_every=1", "trainer.mini_batches=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        data={"max_prompt_tokens": 128},
        rollout={"max_batch_size": 4},
        trainer={"steps": 3, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
    )
    reference = _run(tmp, str(config), "reference", 1, ["pipeline.mode=sync"])
    return tmp, str(config), reference


LAYOUTS = {  # DP = 2 in sync mode: the two-node run
    "dp2_periodic": (2, ["pipeline.mode=periodic"]),
    "tp2_dp2_sync": (4, ["parallel.tp=2", "pipeline.mode=sync"]),
    # + the engine probe at DP 2 (replica 0 measures, every rank merges): it must not disturb training
    "tp2_dp2_periodic": (
        4,
        ["parallel.tp=2", "pipeline.mode=periodic", "algorithm.rollout_correction.probe_sequences=4"],
    ),
    "pp2_dp2_sync": (4, ["parallel.pp=2", "pipeline.mode=sync"]),  # rank 0 holds no loss: metrics of the world
}


@pytest.fixture(scope="module")
def layout_run(setup):
    """``layout_run(name)``: (save dir, history) of the 3-step run at ``LAYOUTS[name]``, run once."""
    tmp, config, _ = setup
    done = {}

    def get(name):
        if name not in done:
            world, overrides = LAYOUTS[name]
            done[name] = _run(tmp, config, name, world, overrides)
        return done[name]

    return get


def _run(tmp, config, name, world, overrides):
    out = tmp / name
    ranks = run_distributed(
        train_recorded, world, config, [*COMMON, *overrides, f"trainer.save_dir={out}"], timeout_s=600
    )
    history, results = ranks[0]
    return out, history, results


def _max_diff(a_dir, b_dir) -> float:
    a, b = load_weights(a_dir / "model"), load_weights(b_dir / "model")
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_same_weights(tmp, ref_dir, out_dir):
    moved = _max_diff(tmp, ref_dir / "step_3")
    assert moved > 1e-3, "training did not move the weights"
    diff = _max_diff(ref_dir / "step_3", out_dir / "step_3")
    print(f"max |weight diff| vs DP=1: {diff:.2e} (training moved them by {moved:.2e})")
    assert diff <= TOL, f"weights differ from the DP=1 run by {diff:.2e}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_data_parallel_run_equals_the_dp1_run(setup, layout_run, layout):
    """Groups routed to replicas by tokens; each mini-batch's update is the DP=1 update."""
    tmp, _, (ref_dir, ref_hist, _) = setup
    out, history, results = layout_run(layout)
    assert_same_weights(tmp, ref_dir, out)
    assert_same_history(history, ref_hist)
    if "periodic" in layout:
        assert_engine_sampled_from_trained_weights(tmp, out, results)
    if any("probe_sequences" in o for o in LAYOUTS[layout][1]):
        assert_probe_measured_round_off(history)


def assert_probe_measured_round_off(history):
    """After each sync the engines (fp32 hf) score 4 just-trained sequences; the policy agrees to
    round-off, over fewer tokens than the probe packed (its responses, not the prompts too)."""
    probed = [h for h in history if "mismatch_probe/n_tokens" in h]
    assert len(probed) >= 2, [sorted(h) for h in history]
    for h in probed:
        assert 0 < h["mismatch_probe/n_tokens"] < h["probe/tokens"], h
        assert h["probe/sequences"] == 4.0 and h["mismatch_probe/logprob_abs_diff_max"] <= 1e-4, h


def assert_same_history(history, ref_hist):
    assert [h["train/optimizer_steps"] for h in history] == [2] * 3
    assert [h["train/responses"] for h in history] == [h["train/responses"] for h in ref_hist]
    for h in history:  # both replicas trained (2.0 would be everything on one)
        assert 1.0 <= h["train/dp_imbalance"] < 2.0
    assert_same_loss_metrics(history, ref_hist)


def assert_same_loss_metrics(history, ref_hist):
    """``loss/*`` and ``mismatch/*`` are the world's (every replica's tokens, logged whatever stage
    rank 0 holds): equal to the DP = 1 run's, which saw the same batches whole."""
    for step, (h, ref) in enumerate(zip(history, ref_hist, strict=True)):
        keys = sorted(k for k in ref if k.startswith(("loss/", "mismatch/")) and k != "loss/grad_norm")
        assert "loss/n_tokens" in keys and "mismatch/kl_k3" in keys, keys
        for key in keys:
            assert h.get(key) == pytest.approx(ref[key], rel=1e-4, abs=1e-6), f"step {step + 1}: {key}"


def test_two_node_dp2_sync_run_equals_the_one_node_run(setup):
    """Two torchrun invocations (--nnodes 2, one rank each, localhost) make one DP = 2 world
    (the sync-mode DP = 2 case) and end where the one-node run does."""
    tmp, config, (ref_dir, ref_hist, _) = setup
    out, port = tmp / "two_nodes", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "megatron_rl",
                "train",
                config,
                "--platform",
                TRAIN_PLATFORM,
                *COMMON,
                "pipeline.mode=sync",
                f"trainer.save_dir={out}",
                f"trainer.log_dir={tmp / 'two_nodes_logs'}",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    assert_same_weights(tmp, ref_dir, out)
    lines = (tmp / "two_nodes_logs" / "metrics.jsonl").read_text().splitlines()
    assert_same_history([json.loads(line) for line in lines], ref_hist)


RESUMES = {  # saved by -> resumed at (world, overrides)
    "tp2_dp2_to_tp1_dp1": ("tp2_dp2_sync", 1, []),
    "tp1_dp1_to_tp2_dp2_distributed_optimizer": (
        "reference",
        4,
        ["parallel.tp=2", "parallel.distributed_optimizer=true"],
    ),
}


@pytest.mark.parametrize("direction", list(RESUMES))
def test_resume_on_another_layout_continues_exactly(setup, layout_run, direction):
    """A step-2 checkpoint (weights + Adam state per HF parameter) resumed at another layout:
    step 3 ends with the uninterrupted run's weights and optimizer state."""
    tmp, config, (ref_dir, _, _) = setup
    saved_by, world, layout = RESUMES[direction]
    saved = ref_dir if saved_by == "reference" else layout_run(saved_by)[0]
    out, history, _ = _run(
        tmp,
        config,
        f"resumed_{direction}",
        world,
        [*layout, "pipeline.mode=sync", f"trainer.resume_from={saved / 'step_2'}"],
    )
    assert len(history) == 1
    assert_same_weights(tmp, ref_dir, out)
    want, got = _optimizer_state(ref_dir / "step_3"), _optimizer_state(out / "step_3")
    assert want.keys() == got.keys() and any(k.startswith("exp_avg_sq/") for k in want)
    diff = max((want[k] - got[k]).abs().max().item() / want[k].abs().max().item() for k in want)
    print(f"max relative |Adam state diff| vs the uninterrupted run: {diff:.2e}")
    assert diff <= 1e-4


def _optimizer_state(checkpoint) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted((checkpoint / "optimizer").glob("*.safetensors")):
        out.update(load_file(file))
    return out
