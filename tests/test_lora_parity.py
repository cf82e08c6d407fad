"""LoRA adapters on the megatron policy equal the ``peft`` library's on the HF model: the same
adapters (seeded random A and B) give the same logits and the same adapter gradients at TP 1,
TP 2 and PP 2 (fp32, <= 1e-5 relative); base weights get no gradient; a fresh adapter's A is the
same at every TP layout; the merged weight reproduces the adapted linear."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.lora import LoraSettings
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

RANK, ALPHA = 4, 8.0
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", seed=3)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(11))


def _mean_logprob(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).mean()


@pytest.fixture(scope="module")
def peft_reference(checkpoint, input_ids):
    """PEFT on the HF model with seeded random A and B: (adapter tensors, logits, adapter grads)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, lora_dropout=0.0)
    model = get_peft_model(hf, config)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    logits = model(input_ids).logits
    (-_mean_logprob(logits, input_ids)).backward()
    grads = {n.replace(".default", ""): p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(grads) == sorted(tensors) and len(tensors) == 2 * len(PEFT_TARGETS) * 4
    return tensors, logits.detach(), grads


def _lora_worker(tp, pp, path, tensors, input_ids):
    from megatron_rl.lora import apply_lora, iter_peft_tensors, load_peft_tensors, lora_parameters
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.gather import gather_tp
    from megatron_rl.parallel.inference import forward_logits
    from megatron_rl.parallel.schedule import run_schedule
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

    initialize_parallel(tp=tp, pp=pp)
    model, spec = load_model_from_hf(path)
    adapted = apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA), spec)
    fresh = {k: v.clone() for k, v in iter_peft_tensors(model, gather_tp)}
    load_peft_tensors(model, tensors)
    logits = forward_logits(model, input_ids, vocab_size=spec.vocab_size)

    def loss(output, ids):
        return -vocab_parallel_logprobs(output[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size).mean(), None

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    forward = lambda m, ids: m(ids, positions, attention_mask=None)
    run_schedule(model, [input_ids], forward_step=forward, loss=loss, seq_length=lambda ids: 24, forward_only=False)
    adapter_ids = {id(p) for p in lora_parameters(model)}
    return {
        "adapted": adapted,
        "fresh": fresh,
        "logits": logits,
        "grads": dict(iter_peft_tensors(model, gather_tp, grad=True)),
        "lora": sorted(n for n, p in model.named_parameters() if id(p) in adapter_ids),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "with_grad": sorted(n for n, p in model.named_parameters() if p.grad is not None),
        "merged": _merged_error(model),
    }


def _merged_error(model) -> float:
    """Largest |linear_fc1(x) - x @ merged_weight^T| over this stage's first layer."""
    from megatron_rl.lora import merged_weight

    fc1 = model.decoder.layers[0].mlp.linear_fc1
    x = torch.randn(3, 2, fc1.weight.shape[1], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (fc1(x)[0] - torch.nn.functional.linear(x, merged_weight(fc1))).abs().max().item()


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_lora_matches_peft(checkpoint, input_ids, peft_reference, tp, pp):
    tensors, ref_logits, ref_grads = peft_reference
    results = run_distributed(_lora_worker, tp * pp, tp, pp, str(checkpoint), tensors, input_ids)
    grads, fresh = {}, {}
    for per_rank in results:
        assert _relative(per_rank["logits"], ref_logits) <= RTOL
        assert per_rank["merged"] <= 1e-5
        grads.update(per_rank["grads"])
        fresh.update(per_rank["fresh"])
        assert per_rank["lora"] == per_rank["trainable"] == per_rank["with_grad"], "a base weight is trainable"
        assert len(per_rank["lora"]) == 14 * len(per_rank["adapted"]) // 4  # per layer: 7 parts of 4 linears
    assert sorted(grads) == sorted(ref_grads)
    for key, ref in ref_grads.items():
        assert _relative(grads[key], ref) <= RTOL, key
    for key, value in fresh.items():  # PEFT's init: B zeros, A kaiming-uniform
        assert torch.count_nonzero(value) == (0 if ".lora_B." in key else value.numel()), key
        assert ".lora_B." in key or value.abs().max() <= 1 / value.shape[1] ** 0.5, key


def _fresh_worker(tp, path):
    from megatron_rl.lora import apply_lora, iter_peft_tensors
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.gather import gather_tp
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=tp, pp=1)
    model, spec = load_model_from_hf(path)
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, target_modules=("linear_qkv", "linear_proj")), spec)
    return dict(iter_peft_tensors(model, gather_tp))


@pytest.mark.slow
@pytest.mark.multiproc
def test_fresh_adapters_are_the_same_at_tp1_and_tp2(checkpoint):
    (one,) = run_distributed(_fresh_worker, 1, 1, str(checkpoint))
    assert len(one) == 4 * 4 * 2  # q, k, v, o of 4 layers
    for two in run_distributed(_fresh_worker, 2, 2, str(checkpoint)):
        assert sorted(two) == sorted(one)
        for key, value in one.items():
            assert torch.equal(two[key], value), key


def test_settings_name_the_bad_field():
    assert LoraSettings(rank=8, alpha=16).scale == 2.0
    for kwargs, field in [
        (dict(rank=0, alpha=1), "rank"),
        (dict(rank=2.0, alpha=1), "rank"),
        (dict(rank=2, alpha=0), "alpha"),
        (dict(rank=2, alpha=1, dropout=1.0), "dropout"),
        (dict(rank=2, alpha=1, target_modules=("q_proj",)), "target_modules"),
        (dict(rank=2, alpha=1, target_modules=()), "target_modules"),
    ]:
        with pytest.raises(ValueError, match=f"LoraSettings.{field}"):
            LoraSettings(**kwargs)
