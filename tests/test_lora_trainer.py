"""LoRA in the trainer: megatron's DDP and optimizer hold the adapters and nothing else.

``build_policy_trainer`` with ``TrainerSettings.lora`` puts the adapters on the policy before
megatron's DDP / optimizer wrap it. Checked on the emulated 910B device, fp32 and bf16 (with the
distributed optimizer): the optimizer's parameters (fp32 masters under bf16) count exactly the
adapters' elements, base parameters get no ``.grad`` / ``main_grad`` and stay in the model's dtype,
and one optimizer step changes every adapter B (zero at init) and no base weight. The adapter
count is an independent sum over the HF model's shapes (q/k/v/o/gate/up/down of each layer).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rl_fixtures import TRAIN_PLATFORM

pytestmark = [pytest.mark.multiproc]

RANK = 4


def lora_trainer_settings(
    path, *, dtype="float32", distributed_optimizer=False, kl_coef=0.0, mini_batches=1, adam_eps=1e-8
):
    """Trainer settings of a LoRA policy (rank 4, alpha 8, every target) on ``path``; a large
    ``adam_eps`` makes Adam SGD-like (layouts compared on the gradient, not on sign() of tiny entries)."""
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, ParallelConfig, TrainerConfig
    from megatron_rl.lora import LoraSettings
    from megatron_rl.trainer.build import TrainerSettings

    return TrainerSettings(
        hf_path=path,
        ref_path=path,
        model=ModelConfig(hf_path=path, dtype=dtype),
        attention=AttentionConfig(backend="split"),
        parallel=ParallelConfig(distributed_optimizer=distributed_optimizer),
        loss=LossSettings(kind="grpo", kl_coef=kl_coef),
        trainer=TrainerConfig(steps=1, lr=1e-2, mini_batches=mini_batches, adam_eps=adam_eps),
        lora=LoraSettings(rank=RANK, alpha=8.0),
    )


def _optimizer_worker(path, dtype, distributed_optimizer):
    from megatron_rl.lora import lora_parameters
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer
    from tests.test_policy_trainer import make_groups

    initialize_parallel(tp=1, pp=1, platform=TRAIN_PLATFORM)
    settings = lora_trainer_settings(path, dtype=dtype, distributed_optimizer=distributed_optimizer)
    trainer, policy, spec = build_policy_trainer(settings)
    adapters = {id(p) for p in lora_parameters(policy)}
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer.begin_batch()
    trainer.train_micro_batch(make_micro_batch(make_groups(spec.vocab_size), policy_version=0))
    result = trainer.finish_mini_batch()
    groups = trainer.optimizer.param_groups
    base = [(n, p) for n, p in policy.named_parameters() if id(p) not in adapters]
    return {
        "loss": float(result.loss),
        "optimizer_numel": sum(p.numel() for g in groups for p in g["params"]),
        "optimizer_dtypes": sorted({str(p.dtype) for g in groups for p in g["params"]}),
        "adapter_numel": sum(p.numel() for p in lora_parameters(policy)),
        "base_dtypes": sorted({str(p.dtype) for _, p in base}),
        "base_with_grad": [n for n, p in base if p.grad is not None or getattr(p, "main_grad", None) is not None],
        "base_trainable": [n for n, p in base if p.requires_grad],
        "base_changed": [n for n, p in base if not torch.equal(p.detach(), before[n])],
        "b_unchanged": [
            n for n, p in policy.named_parameters() if n.endswith("lora_B") and torch.equal(p.detach(), before[n])
        ],
        "b_count": sum(n.endswith("lora_B") for n, _ in policy.named_parameters()),
    }


def expected_adapter_numel(path) -> int:
    """r * (in + out) summed over every q/k/v/o/gate/up/down projection of the HF model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    linears = [m for n, m in hf.named_modules() if n.rsplit(".", 1)[-1] in names]
    return sum(RANK * (m.in_features + m.out_features) for m in linears)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "llama", "llama", tied=True, layers=2))


@pytest.mark.parametrize(
    ("dtype", "distributed_optimizer"), [("float32", False), ("bfloat16", True)], ids=["fp32", "bf16-distopt"]
)
def test_optimizer_holds_only_the_adapters(checkpoint, dtype, distributed_optimizer):
    ((r,),) = [run_distributed(_optimizer_worker, 1, checkpoint, dtype, distributed_optimizer)]
    expected = expected_adapter_numel(checkpoint)
    assert r["adapter_numel"] == expected
    assert r["optimizer_numel"] == expected, "the optimizer holds parameters other than the adapters"
    assert r["optimizer_dtypes"] == ["torch.float32"]  # fp32 masters (bf16) / the fp32 adapters
    assert r["base_dtypes"] == [f"torch.{dtype}"]  # the frozen base stays in the model's dtype
    assert not r["base_trainable"] and not r["base_with_grad"], "a base weight has a gradient"
    assert not r["base_changed"], "the optimizer step moved a base weight"
    assert r["b_count"] == 2 * 7 and not r["b_unchanged"], "an adapter did not move"
    assert r["loss"] == r["loss"]
