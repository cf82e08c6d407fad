"""A LoRA policy saved and resumed continues exactly, at the same layout and across layouts
(TP 1 -> TP 2, PP 1 -> PP 2; a bf16 base with fp32 master adapters at TP 2), on the emulated NPU.

Reference: one LoRA trainer (``build_policy_trainer`` with ``TrainerSettings.lora``: megatron
DDP + optimizer over the adapters only) taking 4 batches of 2 optimizer steps each (the old
policy is the adapters' snapshot at the batch start) on fixed groups. Subject: a trainer
taking 2 batches at layout A and saving (``checkpoint.save_policy``: PEFT adapter + Adam state
per PEFT name, no base weights), then a fresh trainer at layout B built from the base,
restored with ``checkpoint.load_policy_state`` (adapters, then optimizer), taking the last 2.
Losses of batches 3-4 and the adapters and Adam state after batch 4 must match the straight
run's (an independent pass at its own layout)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.test_policy_trainer import make_groups

STEPS, SAVE_AT = 4, 2


def _settings(path, dtype: str):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, TrainerConfig
    from megatron_rl.lora import LoraSettings
    from megatron_rl.trainer.build import TrainerSettings

    return TrainerSettings(
        hf_path=str(path),
        model=ModelConfig(hf_path=str(path), dtype=dtype),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kind="grpo"),
        trainer=TrainerConfig(steps=STEPS, lr=1e-2, weight_decay=0.01, grad_clip=100.0, mini_batches=2),
        lora=LoraSettings(rank=4, alpha=8.0, seed=1),
    )


def _train(trainer, vocab: int, batches: int) -> list[float]:
    """``batches`` batches of two optimizer steps (mini-batches); the losses of every step."""
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch

    losses = []
    chunks = list(chunk_by_tokens(make_groups(vocab), 24))
    for _ in range(batches):
        trainer.begin_batch()  # the old policy: the adapters now
        for half in (chunks[: len(chunks) // 2], chunks[len(chunks) // 2 :]):
            for chunk in half:
                trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
            result = trainer.finish_mini_batch()
            assert not result.skipped
            losses.append(result.loss)
    return losses


def _run_worker(path, out, dtype, layout, phase):
    """One world: ``phase`` "first" trains straight (4 batches) and the saved run (2 batches) at
    ``layout``; "resume" resumes the saved run at ``layout`` for the last 2. Each saves at its end."""
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer
    from megatron_rl.trainer.checkpoint import load_policy_state, resume_policy_path, save_policy
    from tests.rl_fixtures import TRAIN_PLATFORM

    tp, pp = layout
    initialize_parallel(tp=tp, pp=pp, platform=TRAIN_PLATFORM)
    losses = {}
    if phase == "first":
        runs = (("straight", STEPS), ("saved", SAVE_AT))
    else:
        runs = (("resumed", STEPS - SAVE_AT),)
    for name, batches in runs:
        base = resume_policy_path(out / "saved", lora=True, base_path=path) if name == "resumed" else path
        trainer, policy, spec = build_policy_trainer(_settings(base, dtype))
        if name == "resumed":
            load_policy_state(trainer.optimizer, policy, spec, out / "saved")
        losses[name] = _train(trainer, spec.vocab_size, batches)
        save_policy(trainer.optimizer, policy, spec, out / name, source_dir=path, save_merged=False)
    return losses


def _files(directory) -> dict[str, torch.Tensor]:
    from tests.rl_fixtures import load_weights

    return {
        f"{sub}:{k}": v.float() for sub in ("adapter", "optimizer") for k, v in load_weights(directory / sub).items()
    }


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


CASES = {  # dtype, layout saved at, layout resumed at, tolerance (relative)
    "same_layout_tp1": ("float32", (1, 1), (1, 1), 1e-6),
    "tp1_to_tp2": ("float32", (1, 1), (2, 1), 1e-5),
    "pp1_to_pp2": ("float32", (1, 1), (1, 2), 1e-5),
    "tp2_bf16_fp32_master": ("bfloat16", (2, 1), (2, 1), 1e-6),  # bf16 across layouts: bf16 numerics, not resume
}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(CASES))
def test_lora_resume_equals_a_straight_run(tmp_path, case):
    dtype, first, then, tol = CASES[case]
    path = make_tiny_hf(tmp_path / "hf", "llama", layers=2)
    out = tmp_path / "runs"
    straight = run_distributed(_run_worker, first[0] * first[1], path, out, dtype, first, "first")[-1]
    resumed = run_distributed(_run_worker, then[0] * then[1], path, out, dtype, then, "resume")[-1]
    assert not (out / "saved" / "model").exists(), "the base was rewritten into the checkpoint"
    config = json.loads((out / "saved" / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, str(path))
    want, got, start = _files(out / "straight"), _files(out / "resumed"), _files(out / "saved")
    assert want.keys() == got.keys() and any(k.startswith("optimizer:exp_avg/") for k in want)
    assert any(k.startswith("optimizer:param/") for k in want) == (dtype == "bfloat16")
    moved = max((want[k] - start[k]).abs().max().item() for k in want if k.startswith("adapter:"))
    assert moved > 1e-4, "training did not move the adapters"
    diffs = {k: _relative(got[k], want[k]) for k in want}
    worst = max(diffs, key=diffs.get)
    print(f"{case}: worst relative diff {diffs[worst]:.2e} ({worst}); adapters moved {moved:.2e} in steps 3-4")
    assert diffs[worst] <= tol, f"{worst}: resumed differs from straight by {diffs[worst]:.3e}"
    assert straight["straight"][: 2 * SAVE_AT] == pytest.approx(straight["saved"], rel=1e-6)
    assert resumed["resumed"] == pytest.approx(straight["straight"][2 * SAVE_AT :], rel=tol)
    meta = json.loads((out / "resumed" / "optimizer" / "optimizer.json").read_text())
    assert meta["step"] == 2 * STEPS  # two optimizer steps per batch, counted on after the resume


def _rl_run(config, overrides, out):
    from tests.rl_fixtures import train_recorded

    ranks = run_distributed(
        train_recorded, 1 if "parallel.tp=2" not in overrides else 2, config, [*overrides, f"trainer.save_dir={out}"]
    )
    return ranks[0]


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_rl_run_resumed_across_tp_equals_a_straight_one(tmp_path):
    """The real run (``trainer.train``, hf engine, emulated NPU): 3 LoRA steps straight at TP 1
    == 1 step, its checkpoint (adapters, Adam state, controller, prompt stream; no base weights;
    merged/ as asked), then a world at TP 2 resuming for 2. The resumed engines sample step 1's
    requests exactly as the straight run's did (they got the merged adapters before generating),
    the losses of steps 2-3 and the adapters after step 3 match."""
    from tests.rl_fixtures import load_weights, make_tiny_rl_model, tiny_rl_config

    model = make_tiny_rl_model(tmp_path / "model")
    config = str(
        tiny_rl_config(
            tmp_path,
            model,
            reward={"fn": "tests.rl_fixtures:digit_share_reward"},
            trainer={"steps": 3, "prompts_per_batch": 4, "lr": 1e-2, "save_every": 1},
            lora={"rank": 4, "alpha": 8.0, "save_merged": True},
        )
    )
    sync = ["pipeline.mode=sync"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    history, results = _rl_run(config, sync, straight)
    step_1 = straight / "step_1"
    assert (step_1 / "adapter" / "adapter_model.safetensors").is_file() and (step_1 / "merged").is_dir()
    assert not (step_1 / "model").exists(), "the base was rewritten into the checkpoint"
    history_r, results_r = _rl_run(config, [*sync, "parallel.tp=2", f"trainer.resume_from={step_1}"], resumed)
    assert [h["train/version"] for h in history_r] == [2.0, 3.0]
    for key in ("loss/value", "loss/grad_norm"):
        got, want = [h[key] for h in history_r], [h[key] for h in history[1:]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-9), key  # GRPO losses sit near 0
    first = {r.request_id: r for r in results if r.request_id.startswith("1/")}
    again = {r.request_id: r for r in results_r if r.request_id.startswith("1/")}
    assert sorted(first) == sorted(again) and first
    for rid, r in first.items():  # the same weights sample the same tokens with the same log-probs
        assert again[rid].response_ids == r.response_ids, rid
        assert again[rid].logprobs == pytest.approx(r.logprobs, abs=1e-5), rid
    a, b = load_weights(straight / "step_3" / "adapter"), load_weights(resumed / "step_3" / "adapter")
    start = load_weights(step_1 / "adapter")
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-4, "training did not move the adapters"
    for key in a:
        assert _relative(b[key], a[key]) <= 1e-4, key
