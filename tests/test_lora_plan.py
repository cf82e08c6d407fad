"""The tri-model plan with LoRA: kept copies are shared with the policy's module, with reasons;
skipping rules are the full fine-tune's; offloading is refused (nothing to offload)."""

from __future__ import annotations

import pytest

from megatron_rl.algorithms.losses import LossSettings
from megatron_rl.trimodel.plan import Residency, plan_trimodel


def test_kept_copies_share_the_policy_module():
    plan = plan_trimodel(LossSettings(kl_coef=0.1), optimizer_steps_per_batch=2, lora=True)
    assert (plan.old.residency, plan.ref.residency) == (Residency.SHARED, Residency.SHARED)
    assert plan.active == ("policy", "old", "ref") and plan.own_weights == ("policy",)
    assert plan.old.reason.startswith("old shared:") and "adapter snapshot" in plan.old.reason
    assert "2 optimizer steps per batch" in plan.old.reason
    assert plan.ref.reason.startswith("ref shared:") and "adapters off" in plan.ref.reason
    assert "kl_coef = 0.1" in plan.ref.reason
    full = plan_trimodel(LossSettings(kl_coef=0.1), optimizer_steps_per_batch=2)
    assert full.own_weights == ("policy", "old", "ref") and not full.lora


def test_skipped_copies_stay_skipped():
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1, lora=True)
    assert (plan.old.residency, plan.ref.residency) == (Residency.SKIPPED, Residency.SKIPPED)
    assert plan.active == ("policy",)


@pytest.mark.parametrize(
    ("flag", "key"), [("offload_old", "trainer.offload_old"), ("offload_ref", "trainer.offload_reference")]
)
def test_offload_with_lora_is_refused(flag, key):
    with pytest.raises(ValueError, match=f"{key} with LoRA"):
        plan_trimodel(LossSettings(kl_coef=0.1), optimizer_steps_per_batch=2, lora=True, **{flag: True})
