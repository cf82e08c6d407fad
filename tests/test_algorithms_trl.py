"""Peer agreement: our losses equal TRL ``GRPOTrainer._compute_loss`` on the same tensors.

TRL's loss code is called, not re-derived: ``_compute_loss`` runs unbound on a namespace that
carries the attributes it reads, and the model forward (``_get_per_token_logps_and_entropies``)
is replaced by one that returns our fixed per-token log-probs, so gradients flow back to them.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer  # a test dependency (setup.py extras "test")

from megatron_rl.algorithms import LossSettings, loss_denominator, policy_loss

B, L, MAX_LEN = 4, 7, 9
LENGTHS = [7, 2, 5, 4]


class _SingleProcess:
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def _trl_loss(loss_type, logp, old, ref, mask, adv, *, eps_low, eps_high, beta, accum=1):
    """TRL's loss and logged metrics for one micro-batch (``accum``: accumulation steps)."""
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=accum),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accum,
        max_completion_length=MAX_LEN,
        accelerator=_SingleProcess(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    n = logp.shape[0]
    inputs = {
        "prompt_ids": torch.zeros(n, 3, dtype=torch.long),
        "prompt_mask": torch.ones(n, 3, dtype=torch.long),
        "completion_ids": torch.zeros(n, logp.shape[1], dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(sum(LENGTHS))),  # the whole generation batch
    }
    return GRPOTrainer._compute_loss(fake, None, inputs), fake._metrics["train"]


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, L, generator=g) * 2 - 0.05).requires_grad_()
    old = logp.detach() + 0.25 * torch.randn(B, L, generator=g)
    ref = logp.detach() + 0.3 * torch.randn(B, L, generator=g)
    mask = torch.tensor([[1.0] * n + [0.0] * (L - n) for n in LENGTHS])
    adv = torch.tensor([1.1, -0.4, 0.7, -1.3])
    return logp, old, ref, mask, adv


CASES = [  # (our kind, TRL loss_type, clip_low, clip_high, kl coef)
    ("grpo", "grpo", 0.2, 0.2, 0.0),
    ("grpo", "grpo", 0.2, 0.2, 0.04),
    ("bnpo", "bnpo", 0.2, 0.2, 0.0),
    ("bnpo", "bnpo", 0.1, 0.3, 0.1),
    ("dr_grpo", "dr_grpo", 0.2, 0.2, 0.0),
    ("dr_grpo", "dr_grpo", 0.2, 0.28, 0.04),
    ("dapo", "dapo", 0.2, 0.28, 0.0),
    ("dapo", "dapo", 0.2, 0.28, 0.04),
]


@pytest.mark.parametrize("kind, trl_type, lo, hi, beta", CASES)
def test_loss_and_grad_equal_trl(kind, trl_type, lo, hi, beta):
    logp, old, ref, mask, adv = _tensors(seed=11)
    s = LossSettings(kind=kind, clip_low=lo, clip_high=hi, kl_coef=beta, kl_estimator="k3", max_response_len=MAX_LEN)
    ours = policy_loss(
        s, logp=logp, old_logp=old, ref_logp=ref, mask=mask, advantages=adv, denominator=loss_denominator(s, mask)
    )
    (g_ours,) = torch.autograd.grad(ours.loss, logp)
    trl, trl_metrics = _trl_loss(trl_type, logp, old, ref, mask, adv, eps_low=lo, eps_high=hi, beta=beta)
    (g_trl,) = torch.autograd.grad(trl, logp)
    torch.testing.assert_close(ours.loss, trl, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g_ours, g_trl, rtol=1e-6, atol=1e-8)
    log = ours.metrics.to_log(prefix="")
    assert log["clip_frac_low"] == pytest.approx(trl_metrics["clip_ratio/low_mean"][0])
    assert log["clip_frac_high"] == pytest.approx(trl_metrics["clip_ratio/high_mean"][0])
    assert log["clip_frac_low"] + log["clip_frac_high"] > 0  # the fixture clips something
    if beta:
        assert log["kl_ref"] == pytest.approx(trl_metrics["kl"][0], rel=1e-5)


@pytest.mark.parametrize("kind", ["grpo", "dapo"])
def test_two_microbatches_sum_equal_trl_accumulation(kind):
    # TRL accumulates micro-batch losses (grpo: each mean / accumulation steps; dapo: each sum /
    # generation-batch tokens); ours divides every micro-batch by the batch denominator.
    logp, old, ref, mask, adv = _tensors(seed=12)
    s = LossSettings(kind=kind, clip_high=0.28)
    den = loss_denominator(s, mask)
    ours, trl = 0.0, 0.0
    for part in (slice(0, 2), slice(2, 4)):
        ours = (
            ours
            + policy_loss(
                s, logp=logp[part], old_logp=old[part], mask=mask[part], advantages=adv[part], denominator=den
            ).loss
        )
        trl = (
            trl
            + _trl_loss(
                kind,
                logp[part],
                old[part],
                ref[part],
                mask[part],
                adv[part],
                eps_low=0.2,
                eps_high=0.28,
                beta=0.0,
                accum=2,
            )[0]
        )
    torch.testing.assert_close(ours, trl, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(
        torch.autograd.grad(ours, logp)[0], torch.autograd.grad(trl, logp)[0], rtol=1e-6, atol=1e-8
    )
