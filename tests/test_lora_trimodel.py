"""The tri-model with LoRA: one module, three log-probs, each equal to an independent model.

A LoRA policy (rank 4, every target, tiny Qwen2) is trained for two optimizer steps (adapters
non-zero), a new batch begins (``refresh_old``: the adapter snapshot) and one more step is taken.
Then one forward-only tri-model run scores packed groups, and on the emulated 910B device at TP 1,
TP 2 and PP 2:

- the reference log-probs equal the BASE model's under HF transformers (adapters off);
- the old log-probs equal ``peft`` on the HF base with the adapters recorded at the batch start;
- the policy log-probs equal ``peft`` with the adapters the policy holds now;
- the adapters after the three steps, gathered to PEFT names, are the same at TP 2 and PP 2 as
  at TP 1.
No reference or old copy is built (``memory_report``: ref 0 bytes, old = the snapshot's bytes).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rl_fixtures import TRAIN_PLATFORM, teacher_forced_logprobs
from tests.test_lora_trainer import RANK, lora_trainer_settings

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ALPHA = 8.0
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SCORED = [(6, (4, 2, 5)), (3, (1, 3))]  # (prompt len, response lens) of the scored groups
ATOL = 5e-5


def _step(trainer, groups) -> float:
    from megatron_rl.pipeline.records import make_micro_batch

    trainer.train_micro_batch(make_micro_batch(groups, policy_version=0))
    return float(trainer.finish_mini_batch().loss)


def _scored_groups(vocab: int):
    from megatron_rl.attention.packing import TokenGroup

    g = torch.Generator().manual_seed(9)
    return [
        TokenGroup(
            prompt_ids=torch.randint(0, vocab, (lp,), generator=g),
            response_ids=tuple(torch.randint(0, vocab, (n,), generator=g) for n in lens),
        )
        for lp, lens in SCORED
    ]


def _worker(tp, pp, path):
    from megatron_rl.attention.packing import pack_groups
    from megatron_rl.lora import iter_peft_tensors
    from megatron_rl.parallel.gather import gather_tp
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import build_policy_trainer
    from megatron_rl.trimodel import Residency
    from tests.test_policy_trainer import make_groups

    plat, _ = initialize_parallel(tp=tp, pp=pp, platform=TRAIN_PLATFORM)
    trainer, policy, spec = build_policy_trainer(
        lora_trainer_settings(path, kl_coef=0.1, mini_batches=2, adam_eps=1e-3)
    )
    tri = trainer.trimodel
    assert tri.old is None and tri.ref is None, "LoRA built a frozen copy"
    assert (tri.plan.old.residency, tri.plan.ref.residency) == (Residency.SHARED, Residency.SHARED)
    groups = make_groups(spec.vocab_size)
    trainer.begin_batch()
    losses = [_step(trainer, groups[:2]), _step(trainer, groups[2:])]
    trainer.begin_batch()  # the snapshot: the adapters after two steps
    at_start = {k: v.cpu() for k, v in iter_peft_tensors(policy, gather_tp)}
    losses.append(_step(trainer, groups))
    now = {k: v.cpu() for k, v in iter_peft_tensors(policy, gather_tp)}
    scored = _scored_groups(spec.vocab_size)
    mbs = [mb.to(plat.device) for mb in pack_groups(scored, token_budget=1000)]
    out = tri.run(
        mbs, loss=lambda lp, i: (lp.policy.sum() * 0, (lp.policy.detach(), lp.old, lp.ref)), forward_only=True
    )
    logprobs = [torch.cat([o[k] for o in out]).cpu() for k in range(3)] if out else None
    memory = tri.memory_report()
    return {
        "losses": losses,
        "at_start": at_start,
        "now": now,
        "logprobs": logprobs,
        "pairs": [(g.prompt_ids.tolist(), r.tolist()) for g in scored for r in g.response_ids],
        "memory": (memory.ref.device_bytes, memory.old.device_bytes, memory.policy.device_bytes),
        "snapshot_bytes": sum(t.numel() * t.element_size() for t in _adapter_tensors(policy)),
    }


def _adapter_tensors(policy):
    from megatron_rl.lora import lora_parameters

    return lora_parameters(policy)


def _peft_logprobs(path, adapters, pairs) -> torch.Tensor:
    """Teacher-forced log-probs under ``peft`` on the HF base with ``adapters`` (PEFT names) loaded."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, lora_dropout=0.0))
    result = set_peft_model_state_dict(model, adapters)
    assert not result.unexpected_keys, result.unexpected_keys
    out = []
    with torch.no_grad():
        for prompt, response in pairs:
            ids = torch.tensor([prompt + response])
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
            out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1))
    return torch.cat(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", seed=3, layers=2))


@pytest.fixture(scope="module")
def tp1(checkpoint):
    return run_distributed(_worker, 1, 1, 1, checkpoint)


def _merged(results, key):
    out = {}
    for r in results:
        out.update(r[key])
    return out


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)])
def test_lora_trimodel_streams_equal_independent_models(checkpoint, tp1, tp, pp):
    results = tp1 if (tp, pp) == (1, 1) else run_distributed(_worker, tp * pp, tp, pp, checkpoint)
    at_start, now = _merged(results, "at_start"), _merged(results, "now")
    assert len(now) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert all(torch.count_nonzero(v) for k, v in at_start.items()), "an adapter is still zero after two steps"
    pairs = results[0]["pairs"]
    base = torch.tensor([x for row in teacher_forced_logprobs(checkpoint, pairs) for x in row], dtype=torch.float32)
    old, policy = _peft_logprobs(checkpoint, at_start, pairs), _peft_logprobs(checkpoint, now, pairs)
    scored = [r for r in results if r["logprobs"] is not None]
    assert scored, "no rank returned log-probs"
    for r in scored:
        lp_policy, lp_old, lp_ref = r["logprobs"]
        assert (lp_ref - base).abs().max() <= ATOL, "reference != the HF base model"
        assert (lp_old - old).abs().max() <= ATOL, "old != peft with the adapters at the batch start"
        assert (lp_policy - policy).abs().max() <= ATOL, "policy != peft with the current adapters"
        assert (lp_old - lp_policy).abs().max() > 1e-3 and (lp_ref - lp_old).abs().max() > 1e-3, "streams too close"
    for r in results:
        ref_bytes, old_bytes, _ = r["memory"]
        assert ref_bytes == 0 and old_bytes == r["snapshot_bytes"] > 0
        assert all(x == x and abs(x) < 1e6 for x in r["losses"])
    if (tp, pp) != (1, 1):  # TP 2 / PP 2 == TP 1: the adapters after the three optimizer steps
        ref_now = _merged(tp1, "now")
        assert sorted(now) == sorted(ref_now)
        for key, value in ref_now.items():
            rel = ((now[key] - value).abs().max() / value.abs().max()).item()
            assert rel <= 1e-4, f"{key}: TP{tp} PP{pp} vs TP1 relative {rel:.2e}"
