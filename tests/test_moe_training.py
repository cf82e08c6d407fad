"""Training a mixture-of-experts policy: the router losses' weight, and every policy loss.

One world of 2 ranks runs everything (one spawn), in three layouts of the same world: DP 2
(the router-loss references and subject), DP 2 × EP 2 (every loss) and PP 2 (the router losses
at DP 1, with a first stage that runs no loss function). Tiny Qwen3-MoE, 4 layers (layer 1
dense), 4 experts, top 2; the four groups of ``make_groups`` with transformers' log-probs + noise
as behaviour log-probs and random top-2 "engine" routes for every forwarded token and layer.

**Router-loss weight** (``platform/patches/moe_aux_loss_scale``). Invariant: the step's objective gets
``Σ_m (d_m / D) · (c_aux · L_aux,m + c_z · L_z,m)`` summed over the sparse layers, L_m being
megatron's per-batch loss of micro-batch m, d_m its share of the RL loss denominator and D the
sum over every micro-batch of the step on every DP rank (grpo: d_m = its sequences). Subject:
``build_policy_trainer`` with both coefficients on, the gradient where the optimizer would
step. Reference, apart from megatron's router losses and their scaling: the same trainer with
both coefficients 0 (the policy-loss gradient) plus the gradient of the weighted sum with L_m
written out here from each router's input (kept in the graph by a forward hook: logits = x·Wᵀ,
softmax, top-k counts, ``E / (k T²) Σ_e count_e Σ_t p_te`` and mean logsumexp²), one backward
per micro-batch through a separately loaded model. Layer 3's loss also reaches layers 0 and 2's
routers through the hidden states. Splits: 1 and several micro-batches per replica, DP 1 (PP 2)
and DP 2. Before the fix the router part was d_m times too large per micro-batch (error 0.75-0.91
of the largest router-loss gradient), after it < 1e-6.

**Every loss** (``config.schema.LossName``; decoupled PPO in both proximal modes) at DP 2 × EP 2,
replaying the engine's routes and not, router losses on, two optimizer steps
(``trainer.mini_batches: 2``: the old copy is a forward of its own and replays too; one case adds
the KL reference, one the entropy bonus): both steps taken, finite losses, every router weight
and local expert moved. Equivalence, independent of the trainer: decoupled PPO's first-step
loss without replay equals the loss written out here from transformers' log-probs (recompute:
ratio 1, weight exp(lp − behav); loglinear at staleness 0: ratio exp(lp − behav), weight 1).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_moe_models import make_tiny_moe
from tests.rl_fixtures import TRAIN_PLATFORM, teacher_forced_logprobs

pytestmark = [pytest.mark.multiproc]

LAYERS, EXPERTS, TOP_K = 4, 4, 2
AUX, Z = 0.2, 0.05  # router-loss coefficients: the router terms are ~10 % of the gradient
BUDGETS = (1000, 24)  # token budget per micro-batch: one micro-batch per replica, several
CASES = {  # name: LossSettings keywords
    "grpo": dict(kind="grpo", entropy_coef=0.01),
    "bnpo": dict(kind="bnpo"),
    "dapo": dict(kind="dapo", clip_high=0.28, kl_coef=0.05, kl_estimator="k3"),
    "dr_grpo": dict(kind="dr_grpo", max_response_len=8),
    "ppo_decoupled-recompute": dict(kind="ppo_decoupled", proximal="recompute"),
    "ppo_decoupled-loglinear": dict(kind="ppo_decoupled", proximal="loglinear"),
}


def _engine_groups(path):
    """The groups (behaviour log-probs: transformers' + noise; random top-2 routes) and, per
    group, transformers' log-probs of each response."""
    from megatron_rl.rollout.types import RoutedExperts
    from tests.test_policy_trainer import make_groups

    g = torch.Generator().manual_seed(11)
    groups = make_groups(300)
    logps = iter(teacher_forced_logprobs(path, [(s.prompt_ids, s.response_ids) for gr in groups for s in gr.samples]))
    out, hf = [], []
    for grp in groups:
        lp = len(grp.samples[0].prompt_ids)
        prompt_routes = torch.rand(lp, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
        samples, hf_lps = [], [next(logps) for _ in grp.samples]
        for s, lps in zip(grp.samples, hf_lps, strict=True):
            behav = torch.tensor(lps) + 0.1 * torch.randn(len(lps), generator=g)
            rest = torch.rand(len(lps) - 1, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
            routes = RoutedExperts(indices=torch.cat([prompt_routes, rest]).numpy().astype(np.int16))
            samples.append(replace(s, behav_logprobs=tuple(behav.tolist()), routed_experts=routes))
        out.append(replace(grp, samples=tuple(samples)))
        hf.append(hf_lps)
    return out, hf


def _settings(path, loss: dict, *, aux: float, z: float, ep: int = 1, replay: bool = False, mini_batches: int = 1):
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, MoeConfig, ParallelConfig, TrainerConfig
    from megatron_rl.trainer.build import TrainerSettings

    moe = MoeConfig(aux_loss_coeff=aux, z_loss_coeff=z)
    return TrainerSettings(
        hf_path=str(path),
        model=ModelConfig(hf_path=str(path), dtype="float32", moe=moe),
        parallel=ParallelConfig(ep=ep),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(**loss),
        routing_replay=replay,
        trainer=TrainerConfig(steps=1, lr=1e-2, mini_batches=mini_batches, grad_clip=100.0),
    )


# ---- router-loss weight ----------------------------------------------------------------------


def _chunks(groups, budget: int, dp: int, rank: int):
    from megatron_rl.pipeline.records import chunk_by_tokens

    return chunk_by_tokens(groups[rank::dp], budget)


def _step_gradient(path, aux: float, chunks, stage: int = 0) -> dict[str, torch.Tensor]:
    """The gradient one optimizer step of the trainer would apply (after 1/D, DP reduction),
    keyed by global layer numbers (stage ``stage`` of PP 2 holds layers 2·stage, 2·stage + 1)."""
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer

    trainer, policy, _ = build_policy_trainer(_settings(path, dict(kind="grpo"), aux=aux, z=Z if aux else 0.0))
    grads: dict[str, torch.Tensor] = {}

    def record():
        for n, p in policy.named_parameters():
            n = re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + 2 * stage}.", n)
            grads[n] = p.main_grad.detach().cpu().clone()
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
    """∇ Σ_m (d_m / D) L_m over every micro-batch of the step (all replicas'), d_m = sequences."""
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trimodel import LogprobSettings, TriModel, plan_trimodel
    from megatron_rl.trimodel.routing import moe_routers

    model, spec = load_model_from_hf(path, attention_backend="split")
    inputs = []
    for router in moe_routers(model):
        router.register_forward_hook(lambda module, args, out: inputs.append((module, args[0])))
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1, offload_old=False, offload_ref=False)
    tri = TriModel(policy=model, old=None, ref=None, plan=plan, logprobs=LogprobSettings(vocab_size=spec.vocab_size))
    seqs = [sum(len(g.samples) for g in chunk) for chunk in all_chunks]
    for chunk, d in zip(all_chunks, seqs, strict=True):
        inputs.clear()

        def loss(lp, _i, d=d):
            total = sum(_router_loss(x, r.weight, r.topk) for r, x in inputs)
            return 0.0 * lp.policy.sum() + total * (d / sum(seqs)), None

        tri.run([make_micro_batch(chunk, policy_version=0).packed], loss=loss)
    return {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def _aux_case(path, mine, every, stage: int = 0, reference: bool = True) -> dict:
    return dict(
        subject=_step_gradient(path, AUX, mine, stage),
        policy=_step_gradient(path, 0.0, mine, stage),
        router=_reference_router_gradient(path, every) if reference else None,
        micro_batches=len(every),
    )


def _worst_relative_error(subject, policy, router) -> float:
    """max over tensors of |subject - (policy + router)| / max |router-loss gradient|."""
    scale = max(g.abs().max().item() for g in router.values())
    return max(
        (got - policy[n] - router.get(n, torch.zeros_like(got))).abs().max().item() / scale
        for n, got in subject.items()
    )


# ---- every loss ------------------------------------------------------------------------------


def _loss_run(path, groups, loss: dict, replay: bool, rank: int) -> dict:
    """Two optimizer steps (mini-batch m trains group 2m + rank); losses and which MoE weights moved."""
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer

    settings = _settings(path, loss, aux=0.01, z=0.001, ep=2, replay=replay, mini_batches=2)
    trainer, policy, _ = build_policy_trainer(settings)
    moe = {n: p.detach().cpu().clone() for n, p in policy.named_parameters() if "router" in n or "local_experts" in n}
    trainer.begin_batch()
    results = []
    for mini in (0, 1):
        trainer.train_micro_batch(make_micro_batch([groups[2 * mini + rank]], policy_version=0, mini_batch=mini))
        results.append(trainer.finish_mini_batch())
    moved = {n: not torch.equal(p.detach().cpu(), moe[n]) for n, p in policy.named_parameters() if n in moe}
    return dict(losses=[r.loss for r in results], skipped=[r.skipped for r in results], moved=moved)


def _written_out_loss(mode: str, groups_and_logps, clip: float = 0.2) -> float:
    """Decoupled PPO's token-mean loss at the first step (default clip 0.2 both sides)."""
    total, tokens = 0.0, 0
    for grp, logps in groups_and_logps:
        for adv, sample, lps in zip(grp.advantages.tolist(), grp.samples, logps, strict=True):
            for lp, behav in zip(lps, sample.behav_logprobs, strict=True):
                ratio, weight = (1.0, math.exp(lp - behav)) if mode == "recompute" else (math.exp(lp - behav), 1.0)
                total += -min(ratio * adv, min(max(ratio, 1 - clip), 1 + clip) * adv) * weight
                tokens += 1
    return total / tokens


# ---- the world -------------------------------------------------------------------------------


def _world_worker(path, groups):
    from megatron_rl.parallel.state import destroy_parallel, initialize_parallel

    out: dict = {"aux": {}}
    _, layout = initialize_parallel(tp=1, pp=1, platform=TRAIN_PLATFORM)
    for budget in BUDGETS:
        every = [c for r in range(2) for c in _chunks(groups, budget, 2, r)]
        out["aux"][2, budget] = _aux_case(path, _chunks(groups, budget, 2, layout.dp_rank), every)
        out["aux"]["reference", budget] = _reference_router_gradient(path, _chunks(groups, budget, 1, 0))
    destroy_parallel(keep_world=True)
    _, layout = initialize_parallel(tp=1, pp=1, ep=2, platform=TRAIN_PLATFORM)
    out["losses"] = {
        (name, replay): _loss_run(path, groups, loss, replay, layout.dp_rank)
        for name, loss in CASES.items()
        for replay in (False, True)
    }
    destroy_parallel(keep_world=True)
    _, layout = initialize_parallel(tp=1, pp=2, platform=TRAIN_PLATFORM)
    for budget in BUDGETS:
        mine = _chunks(groups, budget, 1, 0)
        out["aux"][1, budget] = _aux_case(path, mine, mine, stage=layout.pp_rank, reference=False)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    path = make_tiny_moe(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", layers=LAYERS, experts=EXPERTS)
    groups, hf_logprobs = _engine_groups(path)
    return groups, hf_logprobs, run_distributed(_world_worker, 2, path, groups, timeout_s=600)


def test_router_losses_weigh_in_as_the_denominator_weighted_mean(world):
    _, _, ranks = world
    errors = {}
    for dp in (2, 1):
        for budget in BUDGETS:
            if dp == 2:
                case = ranks[0]["aux"][dp, budget]
                other = ranks[1]["aux"][dp, budget]["subject"]  # every replica steps with the same gradient
                assert all(torch.equal(g, other[n]) for n, g in case["subject"].items())
            else:  # PP 2: the two stages' gradients together; the reference of the same split
                stages = [r["aux"][dp, budget] for r in ranks]
                case = {k: {**stages[0][k], **stages[1][k]} for k in ("subject", "policy")}
                case.update(router=ranks[0]["aux"]["reference", budget], micro_batches=stages[0]["micro_batches"])
            assert case["micro_batches"] == dp if budget == BUDGETS[0] else case["micro_batches"] > dp
            routers = [n for n, g in case["router"].items() if n.endswith("router.weight") and g.abs().max() > 0]
            assert len(routers) == 3 and len(case["subject"]) == len(case["policy"])
            errors[f"dp {dp}, {case['micro_batches']} micro-batches"] = _worst_relative_error(
                case["subject"], case["policy"], case["router"]
            )
    print(f"worst |subject - reference| / max |router-loss gradient|: {errors}")
    assert all(err < 1e-4 for err in errors.values()), errors


def test_every_loss_trains_a_moe_policy_with_and_without_replay(world):
    groups, hf_logprobs, ranks = world
    for key, run in ranks[0]["losses"].items():
        for rank in ranks:
            mine = rank["losses"][key]
            assert not any(mine["skipped"]) and all(math.isfinite(v) for v in mine["losses"]), (key, mine)
            assert mine["losses"] == run["losses"], key  # the world's loss, on every rank
            assert sum("router" in n for n in mine["moved"]) == 3
            assert sum("local_experts" in n for n in mine["moved"]) == 3 * 2 * 2  # 3 layers, 2 local experts, fc1 fc2
            assert all(mine["moved"].values()), (key, [n for n, m in mine["moved"].items() if not m])
    first = list(zip(groups[:2], hf_logprobs[:2], strict=True))  # step 1: groups 0 (rank 0) and 1 (rank 1)
    for mode in ("recompute", "loglinear"):
        want = _written_out_loss(mode, first)
        got = ranks[0]["losses"][f"ppo_decoupled-{mode}", False]["losses"][0]
        assert abs(got - want) <= 1e-5 * abs(want), (mode, got, want)
