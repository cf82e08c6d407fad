"""A tiny Qwen3-MoE trains under context parallelism with expert parallelism over the CP ranks,
router load-balancing and z-loss on, and its checkpoint resumes at CP 1 × EP 1 exactly.

World of 2 ranks: the straight run takes 4 optimizer steps of ``PolicyTrainer`` at CP 2 × EP 2
(one replica: each rank holds 2 of the 4 experts and a zigzag half of every micro-batch); the
subject takes 2 there and saves (HF weights, and the Adam state keyed by HF names: the experts
gathered over the EP group, which here is the CP group); a fresh trainer at CP 1 × EP 1 (DP 2,
both replicas train the same groups, so the step equals one replica's) loads both, saves again
at once (every tensor equal to the CP 2 checkpoint bit for bit) and takes the last 2 steps:
weights and Adam state after step 4 match the straight CP 2 × EP 2 run within relative 1e-5
(``test_moe_resume``'s tolerance: expert sums in another order). So steps 3-4 at CP 1 equal
steps 3-4 at CP 2 with router losses, through the trainer's router-loss weighting."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_moe_models import make_tiny_moe
from tests.test_optimizer_resume import SAVE_AT, STEPS, _assert_resumed_equals_straight, _files, _save, _train

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def _settings(path, cp: int, ep: int):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, MoeConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.build import TrainerSettings

    moe = MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    return TrainerSettings(
        hf_path=str(path),
        model=ModelConfig(hf_path=str(path), dtype="float32", moe=moe),
        parallel=ParallelConfig(cp=cp, ep=ep),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kind="grpo"),
        trainer=TrainerConfig(steps=STEPS, lr=1e-3, weight_decay=0.01, grad_clip=100.0),
    )


def _resume_worker(path, out):
    from megatron_rl.parallel.state import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer
    from megatron_rl.trainer.optimizer_state import load_optimizer_state
    from tests.rl_fixtures import TRAIN_PLATFORM

    initialize_parallel(tp=1, pp=1, cp=2, ep=2, platform=TRAIN_PLATFORM)
    trainer, policy, spec = build_policy_trainer(_settings(path, 2, 2))
    experts = {n.split("local_experts.")[1].split(".")[0] for n, _ in policy.named_parameters() if "local_experts" in n}
    assert experts == {"0", "1"}  # 2 of the 4 experts on each CP rank
    _train(trainer, spec.vocab_size, STEPS)
    _save(trainer, policy, spec, out / "straight", path)
    trainer, policy, spec = build_policy_trainer(_settings(path, 2, 2))
    _train(trainer, spec.vocab_size, SAVE_AT)
    _save(trainer, policy, spec, out / "saved", path)
    destroy_parallel(keep_world=True)
    initialize_parallel(tp=1, pp=1, cp=1, ep=1, platform=TRAIN_PLATFORM)
    trainer, policy, spec = build_policy_trainer(_settings(out / "saved" / "model", 1, 1))
    load_optimizer_state(trainer.optimizer, policy, spec, out / "saved" / "optimizer")
    _save(trainer, policy, spec, out / "reloaded", path)
    _train(trainer, spec.vocab_size, STEPS - SAVE_AT)
    _save(trainer, policy, spec, out / "resumed", path)


def test_moe_under_cp_and_ep_resumes_at_cp1(tmp_path, monkeypatch):
    import tests.test_optimizer_resume as dense

    monkeypatch.setattr(dense, "TOL", 1e-5)
    path = make_tiny_moe(tmp_path / "hf", "qwen3_moe", layers=2)
    run_distributed(_resume_worker, 2, path, tmp_path, timeout_s=600)
    saved, reloaded = _files(tmp_path / "saved"), _files(tmp_path / "reloaded")
    assert saved.keys() == reloaded.keys()
    assert any("experts.3.down_proj" in k and k.startswith("optimizer:exp_avg_sq/") for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(tensor, reloaded[key]), f"{key} changed on reload at CP 1 x EP 1"
    _assert_resumed_equals_straight(tmp_path, want_master=False)
