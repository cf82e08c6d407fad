"""The router losses' effective weight: coeff × the denominator-weighted mean of the micro-batches'
losses, whatever the split into micro-batches and DP ranks.

Invariant (``config.schema.MoeConfig``): the step's objective gets
``Σ_m (d_m / D) · (c_aux · L_aux,m + c_z · L_z,m)`` summed over the sparse layers, where L_m is
megatron's per-batch loss of micro-batch m, d_m its share of the RL loss denominator and
D = Σ_m d_m over every micro-batch of the step on every DP rank (here grpo: d_m = its sequences).

Subject: ``build_policy_trainer`` with both coefficients on, one optimizer step's gradient (read
where the optimizer would step). Reference, computed apart from megatron's router losses and
their scaling: the same trainer with both coefficients 0 (the policy-loss gradient), plus the
gradient of the weighted sum above with L_m written out in this file from each router's input
(hidden states kept in the graph by a forward hook on the router: logits = x·Wᵀ, softmax,
top-k counts, ``E / (k T²) Σ_e count_e Σ_t p_te`` and mean logsumexp²), one backward per
micro-batch through a separately loaded copy of the model. Layers 0 and 2 are sparse, so
layer 2's loss also reaches layer 0's router through the hidden states. Splits: 1 and several
micro-batches per rank, at DP 1 and DP 2. Before the fix (loss scale 1 per micro-batch) the aux
part came out d_m times too large per micro-batch and the check failed.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_moe_models import make_tiny_moe
from tests.rl_fixtures import TRAIN_PLATFORM

pytestmark = [pytest.mark.multiproc]

AUX, Z = 0.2, 0.05  # coefficients large enough that the router terms are ~10 % of the gradient
BUDGETS = (1000, 24)  # token budget per micro-batch: one micro-batch per rank, several


def _settings(path, aux: float, z: float):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, MoeConfig, TrainerConfig
    from megatron_rl.trainer.build import TrainerSettings

    moe = MoeConfig(aux_loss_coeff=aux, z_loss_coeff=z)
    return TrainerSettings(hf_path=str(path), model=ModelConfig(hf_path=str(path), dtype="float32", moe=moe),
                           attention=AttentionConfig(backend="split"), loss=LossSettings(kind="grpo"),
                           trainer=TrainerConfig(steps=1, lr=1e-3, grad_clip=100.0))


def _chunks(groups, budget: int, dp: int, rank: int):
    from megatron_rl.pipeline.records import chunk_by_tokens

    return chunk_by_tokens(groups[rank::dp], budget)


def _step_gradient(path, aux: float, z: float, chunks) -> dict[str, torch.Tensor]:
    """The gradient one optimizer step of the trainer would apply (after 1/D, DP reduction)."""
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer

    trainer, policy, _ = build_policy_trainer(_settings(path, aux, z))
    grads: dict[str, torch.Tensor] = {}

    def record():
        grads.update({n: p.main_grad.detach().cpu().clone() for n, p in policy.named_parameters()})
        return True, 0.0, None

    trainer.optimizer.step = record
    trainer.begin_batch()
    for chunk in chunks:
        trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
    assert not trainer.finish_mini_batch().skipped
    return grads


def _router_loss(x: torch.Tensor, weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """c_aux · megatron's switch load-balancing loss + c_z · z-loss of one micro-batch, by hand."""
    logits = (x.reshape(-1, x.shape[-1]) @ weight.t()).float()
    probs = torch.softmax(logits, dim=-1)
    tokens, experts = probs.shape
    counts = torch.zeros_like(probs).scatter(1, probs.topk(top_k, dim=-1).indices, 1.0).sum(0)
    aux = experts / (top_k * tokens**2) * (probs.sum(0) * counts).sum()
    return AUX * aux + Z * torch.logsumexp(logits, dim=-1).square().mean()


def _reference_router_gradient(path, all_chunks) -> dict[str, torch.Tensor]:
    """∇ Σ_m (d_m / D) L_m over every micro-batch of the step (all ranks'), d_m = sequences."""
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trimodel import TriModel, plan_trimodel
    from megatron_rl.trimodel.routing import moe_routers

    model, spec = load_model_from_hf(path, attention_backend="split")
    inputs = []
    for router in moe_routers(model):
        router.register_forward_hook(lambda module, args, out: inputs.append((module, args[0])))
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1, offload_old=False, offload_ref=False)
    tri = TriModel(policy=model, old=None, ref=None, plan=plan, vocab_size=spec.vocab_size)
    seqs = [sum(len(g.samples) for g in chunk) for chunk in all_chunks]
    for chunk, d in zip(all_chunks, seqs, strict=True):
        inputs.clear()

        def loss(lp, _i, d=d):
            total = sum(_router_loss(x, r.weight, r.topk) for r, x in inputs)
            return 0.0 * lp.policy.sum() + total * (d / sum(seqs)), None

        tri.run([make_micro_batch(chunk, policy_version=0).packed], loss=loss)
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def _aux_worker(path, dp: int):
    from megatron_rl.parallel.state import initialize_parallel
    from tests.test_policy_trainer import make_groups

    _, layout = initialize_parallel(tp=1, pp=1, platform=TRAIN_PLATFORM)
    assert layout.dp == dp
    groups = make_groups(300)
    out = {}
    for budget in BUDGETS:
        mine = _chunks(groups, budget, dp, layout.dp_rank)
        every = [c for r in range(dp) for c in _chunks(groups, budget, dp, r)]
        out[budget] = dict(subject=_step_gradient(path, AUX, Z, mine), policy=_step_gradient(path, 0.0, 0.0, mine),
                           router=_reference_router_gradient(path, every), micro_batches=len(every))
    return out


def _worst_relative_error(res) -> float:
    """max over tensors of |subject - (policy + router)| / max |router-loss gradient| (all tensors)."""
    scale = max(g.abs().max().item() for g in res["router"].values())
    worst = 0.0
    for name, got in res["subject"].items():
        want = res["policy"][name] + res["router"].get(name, torch.zeros_like(got))
        worst = max(worst, (got - want).abs().max().item() / scale)
    return worst


@pytest.mark.parametrize("dp", [1, 2])
def test_router_loss_weight_is_the_weighted_mean_over_micro_batches(dp, tmp_path):
    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe", layers=3)
    results = run_distributed(_aux_worker, dp, path, dp)
    errors = {}
    for budget in BUDGETS:
        res = results[0][budget]
        assert res["micro_batches"] == dp if budget == BUDGETS[0] else res["micro_batches"] > dp
        routers = [n for n in res["router"] if n.endswith("router.weight")]
        assert len(routers) == 2 and all(res["router"][n].abs().max() > 0 for n in routers)
        errors[res["micro_batches"]] = _worst_relative_error(res)
        for other in results[1:]:  # every replica steps with the same gradient
            for name, got in other[budget]["subject"].items():
                assert torch.equal(got, res["subject"][name]), name
    print(f"dp {dp}: micro-batches -> worst error / max router-loss gradient: {errors}")
    assert all(err < 1e-4 for err in errors.values()), errors
