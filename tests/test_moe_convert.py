"""MoE configs and conversion without processes: HF config -> MoeSpec / megatron settings for
Qwen3-MoE, Qwen2-MoE and Mixtral, the parallel-fit errors, and HF -> per-rank shards -> HF at
TP 2 x EP 2 bit-exact (each (TP, EP) rank's shard cut from the HF tensors, then reassembled in
megatron's expert group order)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.models.convert import ShardInfo, hf_names, hf_to_shard, load_names, match_rule, shards_to_hf
from megatron_rl.models.hf_config import check_parallel_fit, decoder_spec_from_hf, transformer_config_from_spec
from tests.hf_moe_models import MOE_FAMILIES, make_tiny_moe, tiny_moe_config


def _spec(family: str, layers: int = 2):
    return decoder_spec_from_hf(tiny_moe_config(family, layers=layers).to_dict())


def test_moe_specs_follow_hf_configs():
    q3, q2, mx = (_spec(f, layers=4) for f in MOE_FAMILIES)
    assert (q3.moe.num_experts, q3.moe.top_k, q3.moe.expert_ffn_hidden_size) == (4, 2, 64)
    assert q3.moe.sparse_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert q3.qk_norm and q3.moe.norm_topk_prob and q3.moe.shared_expert_ffn_hidden_size is None
    assert q2.qkv_bias and not q2.moe.norm_topk_prob
    assert (q2.moe.shared_expert_ffn_hidden_size, q2.moe.shared_expert_gate) == (96, True)
    assert mx.moe.norm_topk_prob and mx.moe.router_hf_name == "block_sparse_moe.gate.weight"
    assert decoder_spec_from_hf(
        dict(tiny_moe_config("qwen3_moe").to_dict(), decoder_sparse_step=2)
    ).moe.sparse_layers == (False, False, False, True)  # step 2, and layer 1 dense


def test_router_settings_match_hf_semantics():
    renorm = transformer_config_from_spec(_spec("qwen3_moe"), tp=1, pp=1)
    plain = transformer_config_from_spec(_spec("qwen2_moe"), tp=1, pp=1)
    # renormalised top k == softmax over the top-k logits (pre_softmax False); else softmax first
    assert (renorm.moe_router_pre_softmax, plain.moe_router_pre_softmax) == (False, True)
    assert renorm.moe_layer_freq == [1, 0] and renorm.num_moe_experts == 4 and renorm.moe_router_topk == 2
    assert plain.moe_shared_expert_intermediate_size == 96 and plain.moe_shared_expert_gate
    assert renorm.moe_aux_loss_coeff == 0.0 and renorm.moe_router_load_balancing_type == "none"


def test_parallel_fit_names_ep_problems():
    with pytest.raises(ValueError, match="ep 3 does not divide num_experts \\(4\\)"):
        check_parallel_fit(_spec("qwen3_moe"), 1, 1, 3)
    dense = decoder_spec_from_hf(dict(tiny_moe_config("qwen3_moe").to_dict(), model_type="qwen3", intermediate_size=64))
    with pytest.raises(ValueError, match="ep 2 needs a mixture-of-experts model"):
        check_parallel_fit(dense, 1, 1, 2)
    check_parallel_fit(_spec("mixtral"), 2, 2, 4)


def _megatron_names(spec, ep: int) -> list[str]:
    names = []
    for i, sparse in enumerate(spec.moe.sparse_layers):
        if not sparse:
            names += [f"decoder.layers.{i}.mlp.linear_fc1.weight", f"decoder.layers.{i}.mlp.linear_fc2.weight"]
            continue
        names.append(f"decoder.layers.{i}.mlp.router.weight")
        for j in range(spec.moe.num_experts // ep):
            names += [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc{k}.weight" for k in (1, 2)]
        if spec.moe.shared_expert_gate:
            names += [
                f"decoder.layers.{i}.mlp.shared_experts.{n}"
                for n in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")
            ]
    return names


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_mlp_round_trip_tp2_ep2(family, tmp_path):
    from safetensors.torch import load_file

    state = load_file(make_tiny_moe(tmp_path, family, layers=2) / "model.safetensors")  # the on-disk names
    spec, tp, ep = _spec(family), 2, 2
    seen = set()
    for name in _megatron_names(spec, ep):
        rule, layer = match_rule(name, 0, ep)
        shards = []  # megatron's expert TP x EP group order: TP rank fastest
        for ep_rank in range(ep if rule.kind.startswith("expert") else 1):
            for tp_rank in range(1 if rule.kind == "replicated" else tp):
                shard = ShardInfo(tp_rank=tp_rank, tp_size=tp, padded_vocab=384, ep_rank=ep_rank, ep_size=ep)
                shards.append(hf_to_shard(rule, [state[n] for n in load_names(rule, layer, spec, shard)], spec, shard))
        back = shards_to_hf(rule, shards, spec)
        for n, t in zip(hf_names(rule, layer, spec), back, strict=True):
            assert torch.equal(t, state[n]), f"{name} -> {n}"
            seen.add(n)
    mlp_names = {n for n in state if ".mlp." in n or "block_sparse_moe" in n}
    assert seen == mlp_names


def test_check_config_refuses_bad_ep_and_moe_settings(tmp_path):
    from megatron_rl.config import ConfigError, validate_world
    from tests.test_config import MINIMAL, SMOLLM2, error, load

    moe = dict(tiny_moe_config("qwen3_moe").to_dict(), num_attention_heads=4)
    cases = {
        ("parallel.ep=3",): (moe, "parallel.ep", "3 does not divide num_experts (4"),
        ("parallel.ep=2",): (SMOLLM2, "parallel.ep", "2 needs a mixture-of-experts model"),
        ("parallel.ep=0",): (moe, "parallel.ep", "must be > 0"),
        ("model.moe.load_balancing=sinkhorn",): (moe, "model.moe.load_balancing", "aux_loss"),
        ("model.moe.aux_loss_coeff=-1",): (moe, "model.moe.aux_loss_coeff", "must be >= 0"),
        ("model.megatron={moe_aux_loss_coeff: 0.1}",): (
            moe,
            "model.megatron.moe_aux_loss_coeff",
            "model.moe.aux_loss_coeff",
        ),
    }
    for overrides, (hf, key, text) in cases.items():
        problems = error(tmp_path, MINIMAL, overrides, hf).problems
        assert any(p.key == key and text in p.message for p in problems), (overrides, problems)
    cfg = load(tmp_path, MINIMAL, ("parallel.ep=2", "parallel.tp=2", "model.moe.aux_loss_coeff=0.01"), moe)
    assert validate_world(cfg, 4) == 2
    with pytest.raises(ConfigError, match="parallel.ep \\(2\\) does not divide the data-parallel size 3"):
        validate_world(cfg, 6)
