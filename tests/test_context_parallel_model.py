"""The policy under context parallelism equals CP 1 and transformers: log-probs and gradients.

Subject: a tiny Qwen3 model on the emulated NPU, ``TriModel`` (the trainer's micro-step: the
stage feeds each CP rank its per-segment zigzag slice, attention all-gathers K / V, log-probs are
gathered over CP), wrapped in megatron's DDP (megatron scales the loss by the CP size and
reduces gradients over DP x CP), on a shared-prompt micro-batch of several groups (ragged
responses, K = 1, a length-1 response); also with activation recompute (full, selective) at CP 2
against CP 1 without. References, computed independently: transformers' fp32
forward of every ``[prompt, r_i]`` as its own sequence (log-probs, 1e-5), and the same model at
CP 1 in the same TP / PP layout (every gradient after megatron's reduction, rel 1e-5 of the
tensor's largest entry; both CP ranks hold the same reduced gradients).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rl_fixtures import TRAIN_PLATFORM

pytestmark = [pytest.mark.multiproc]

GROUPS = [(7, (3, 1, 5)), (4, (1,)), (9, (6, 2, 2, 4)), (5, ())]  # (prompt length, response lengths)


def _groups(vocab: int):
    from megatron_rl.attention.packing import TokenGroup

    g = torch.Generator().manual_seed(3)
    return [
        TokenGroup(
            prompt_ids=torch.randint(0, vocab, (lp,), generator=g),
            response_ids=tuple(torch.randint(0, vocab, (n,), generator=g) for n in lens),
        )
        for lp, lens in GROUPS
        if lens
    ]


def _worker(tp, pp, cp, path, recompute=None):
    from megatron.core import parallel_state as ps

    from megatron_rl.algorithms import LossSettings
    from megatron_rl.attention.packing import pack_groups
    from megatron_rl.config.schema import TrainerConfig
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.optim import wrap_for_training
    from megatron_rl.trimodel import LogprobSettings, TriModel
    from megatron_rl.trimodel.plan import plan_trimodel

    initialize_parallel(tp=tp, pp=pp, cp=cp, platform=TRAIN_PLATFORM)
    model, spec = load_model_from_hf(path, attention_backend="split", megatron_overrides=recompute)
    ddp, _ = wrap_for_training(model, TrainerConfig(steps=1))
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1)
    tri = TriModel(policy=ddp, old=None, ref=None, plan=plan, logprobs=LogprobSettings(vocab_size=spec.vocab_size))
    (mb,) = pack_groups(_groups(spec.vocab_size), token_budget=10_000)
    weights = torch.randn(mb.target_ids.numel(), generator=torch.Generator().manual_seed(11))

    def loss(lp, _i):
        w = weights.to(lp.policy.device)
        return (lp.policy * w).sum(), lp.policy.detach().cpu()

    payloads = tri.run([mb], loss=loss)
    grads = {name: p.main_grad.detach().cpu().clone() for name, p in model.named_parameters()}
    where = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_context_parallel_rank())
    return where, (payloads[0] if payloads else None), grads


def _hf_logprobs(path, vocab):
    """transformers' fp32 log-probs of every response token, each [prompt, r_i] on its own."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    out = []
    with torch.no_grad():
        for g in _groups(vocab):
            lp = g.prompt_ids.numel()
            for r in g.response_ids:
                seq = torch.cat([g.prompt_ids, r])
                logp = torch.log_softmax(hf(seq[None]).logits[0].float(), -1)
                out.append(logp[lp - 1 : lp - 1 + r.numel()].gather(-1, r[:, None])[:, 0])
    return torch.cat(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen3", "qwen3", tied=False, layers=2))


def _compare(checkpoint, tp, pp, recompute=None):
    from transformers import AutoConfig

    base = {where[:2]: (lp, grads) for where, lp, grads in run_distributed(_worker, tp * pp, tp, pp, 1, checkpoint)}
    ref_lp = _hf_logprobs(checkpoint, AutoConfig.from_pretrained(checkpoint).vocab_size)
    results = run_distributed(_worker, tp * pp * 2, tp, pp, 2, checkpoint, recompute)
    assert {where[2] for where, _, _ in results} == {0, 1}
    seen_lp = False
    for where, lp, grads in results:
        base_lp, base_grads = base[where[:2]]
        if lp is not None:
            seen_lp = True
            assert (lp - ref_lp).abs().max() <= 1e-5, f"{where}: CP 2 log-probs vs transformers"
            assert (lp - base_lp).abs().max() <= 1e-5, f"{where}: CP 2 log-probs vs CP 1"
        assert grads.keys() == base_grads.keys() and grads
        for name, g in grads.items():
            want = base_grads[name]
            rel = (g - want).abs().max() / want.abs().max().clamp_min(1e-12)
            assert rel <= 1e-5, f"{where} {name}: relative grad error {rel:.2e} vs CP 1"
    assert seen_lp, "no rank returned log-probs"


def test_cp2_equals_cp1_and_transformers(checkpoint):
    _compare(checkpoint, 1, 1)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_cp2_composes_with_tp_and_pp(checkpoint, tp, pp):
    """4 ranks: 52 s (TP 2 x CP 2) and 26 s (PP 2 x CP 2) on the 2-core machine."""
    _compare(checkpoint, tp, pp)


# megatron's recompute re-runs a layer (full) or its core attention (selective) in backward; under
# CP that re-run all-gathers K / V again, after the forward's packed_attention() block has exited
RECOMPUTE = {
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
}


@pytest.mark.parametrize("recompute", sorted(RECOMPUTE))
def test_cp2_with_recompute_equals_cp1_without(checkpoint, recompute):
    """CP 2 with activation recompute: log-probs vs transformers and CP 1, gradients vs CP 1 without recompute."""
    _compare(checkpoint, 1, 1, RECOMPUTE[recompute])
