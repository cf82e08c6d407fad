"""A tiny Qwen3-MoE trains on the emulated accelerator with expert parallelism and the router's
losses on, and its checkpoint (HF weights + the optimizer state keyed by HF names, experts
included) resumes at another layout exactly.

World of 2 ranks: the straight run takes 4 optimizer steps at the first layout, the subject takes
2 there and saves; a fresh trainer at the second layout loads weights and Adam state, saves again
at once (every tensor and the step equal the first checkpoint bit for bit) and takes the last 2
steps: weights and Adam state after step 4 match the straight run within relative 1e-5
(``test_optimizer_resume``'s 1e-6 is for one layout; here each expert sums the two ranks' tokens
in one matmul on one side and over an all-reduce on the other: fp32 order, 1.07e-6 measured).

- ``ep``: EP 2 (both ranks train the same groups; each holds 2 of the 4 experts) -> EP 1 (every
  rank all 4), load-balancing loss on. It caught expert gradients summed over DP across different
  experts when the model config did not carry the EP size (megatron marks expert weights from it).
- ``cp_ep``: CP 2 × EP 2 (one replica: each rank holds 2 of the 4 experts and a zigzag half of
  every micro-batch; the EP group is the CP group) -> CP 1 × EP 1 (DP 2, both replicas train the
  same groups), load-balancing and z-loss on: steps 3-4 at CP 1 equal steps 3-4 at CP 2 through
  the router-loss weighting (``platform/patches/moe_cp_router_losses``).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_moe_models import make_tiny_moe
from tests.test_optimizer_resume import SAVE_AT, STEPS, _assert_resumed_equals_straight, _files, _save, _train

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

# name: (the first layout's CP size, the router's z-loss coefficient); the first layout has EP 2,
# the second is CP 1 x EP 1
LAYOUTS = {"ep": (1, 0.0), "cp_ep": (2, 0.001)}


def _settings(path, *, cp: int, ep: int, z_loss: float):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, MoeConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.build import TrainerSettings

    moe = MoeConfig(aux_loss_coeff=0.01, z_loss_coeff=z_loss)
    return TrainerSettings(
        hf_path=str(path),
        model=ModelConfig(hf_path=str(path), dtype="float32", moe=moe),
        parallel=ParallelConfig(cp=cp, ep=ep),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kind="grpo"),
        trainer=TrainerConfig(steps=STEPS, lr=1e-3, weight_decay=0.01, grad_clip=100.0),
    )


def _resume_worker(path, out, layout: str):
    from megatron_rl.parallel.state import destroy_parallel, initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer
    from megatron_rl.trainer.optimizer_state import load_optimizer_state
    from tests.rl_fixtures import TRAIN_PLATFORM

    cp, z_loss = LAYOUTS[layout]
    initialize_parallel(tp=1, pp=1, cp=cp, ep=2, platform=TRAIN_PLATFORM)
    trainer, policy, spec = build_policy_trainer(_settings(path, cp=cp, ep=2, z_loss=z_loss))
    experts = {n.split("local_experts.")[1].split(".")[0] for n, _ in policy.named_parameters() if "local_experts" in n}
    assert experts == {"0", "1"}  # 2 of the 4 experts on each rank
    _train(trainer, spec.vocab_size, STEPS)
    _save(trainer, policy, spec, out / "straight", path)
    trainer, policy, spec = build_policy_trainer(_settings(path, cp=cp, ep=2, z_loss=z_loss))
    _train(trainer, spec.vocab_size, SAVE_AT)
    _save(trainer, policy, spec, out / "saved", path)
    destroy_parallel(keep_world=True)
    initialize_parallel(tp=1, pp=1, cp=1, ep=1, platform=TRAIN_PLATFORM)
    trainer, policy, spec = build_policy_trainer(_settings(out / "saved" / "model", cp=1, ep=1, z_loss=z_loss))
    load_optimizer_state(trainer.optimizer, policy, spec, out / "saved" / "optimizer")
    _save(trainer, policy, spec, out / "reloaded", path)
    _train(trainer, spec.vocab_size, STEPS - SAVE_AT)
    _save(trainer, policy, spec, out / "resumed", path)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_resumes_at_another_layout(tmp_path, monkeypatch, layout):
    import tests.test_optimizer_resume as dense

    monkeypatch.setattr(dense, "TOL", 1e-5)
    path = make_tiny_moe(tmp_path / "hf", "qwen3_moe", layers=2)
    run_distributed(_resume_worker, 2, path, tmp_path, layout, timeout_s=600)
    saved, reloaded = _files(tmp_path / "saved"), _files(tmp_path / "reloaded")
    assert saved.keys() == reloaded.keys()
    assert any("experts.3.down_proj" in k and k.startswith("optimizer:exp_avg_sq/") for k in saved)
    for key, tensor in saved.items():
        assert torch.equal(tensor, reloaded[key]), f"{key} changed on reload at CP 1 x EP 1 ({layout})"
    _assert_resumed_equals_straight(tmp_path, want_master=False)
