"""Weight sync of experts into vLLM 0.32, without starting an engine.

1. Names: the per-expert HF names our export produces (``models.convert``: megatron's local
   experts at EP 2 -> HF names of every EP rank) go through vLLM's own code: the model's
   ``hf_to_vllm_mapper`` (Qwen3-MoE, Mixtral), then ``RoutedExperts.load_weights`` (vLLM's
   function, called on a stand-in layer whose ``w13_weight`` / ``w2_weight`` record their
   ``weight_loader`` calls) with the name relative to the experts module, as
   ``AutoWeightsLoader`` passes it. Each name must land in exactly one fused parameter with the
   expert id of its name and the shard (w1 gate, w3 up, w2 down) of its projection.
   Qwen2-MoE's gated shared expert (``shared_expert.*``, ``shared_expert_gate``): our exported
   names through the model's mapper and vLLM's ``AutoWeightsLoader`` into vLLM's own
   ``Qwen2MoeMLP`` + gate (built in a one-rank vLLM world); its output must equal transformers'
   ``sigmoid(shared_expert_gate(x)) * shared_expert(x)`` of the same weights.
2. In place on CPU: vLLM's CPU experts pad and prepack the fused weights (a blocked layout of
   the same shape); ``platform.patches.vllm_cpu_weights`` keeps the plain ones, exposes them
   to ``load_weights`` and packs them again into the same storage. Checked on a stand-in layer
   with vLLM's real ``CPUUnquantizedExperts.process_weights_after_loading`` (the padding path:
   intermediate size 40 -> 64): after a sync the packed weights equal a fresh load's bit for bit.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

E, H, FFN, LAYER = 4, 64, 40, 1
FAMILIES = {  # model type: (vLLM model class, experts module prefix, vLLM's checkpoint names gate/down/up)
    "qwen3_moe": ("qwen3_moe.Qwen3MoeModel", "mlp.experts", ("gate_proj", "down_proj", "up_proj")),
    "mixtral": ("mixtral.MixtralModel", "block_sparse_moe.experts", ("w1", "w2", "w3")),
    "qwen2_moe": ("qwen2_moe.Qwen2MoeForCausalLM", "mlp.experts", ("gate_proj", "down_proj", "up_proj")),
}


def _export_names(family: str, local_names: list[str], ep: int = 1) -> list[str]:
    """The HF names our export writes for megatron parameters ``local_names`` (layer LAYER)."""
    from megatron_rl.models.convert import hf_names, match_rule
    from megatron_rl.models.hf_config import decoder_spec_from_hf
    from tests.hf_moe_models import tiny_moe_config

    spec = decoder_spec_from_hf(tiny_moe_config(family, layers=2, experts=E).to_dict())
    rules = [match_rule(f"decoder.layers.{LAYER}.{local}", 0, ep=ep) for local in local_names]
    return [n for rule, layer in rules for n in hf_names(rule, layer, spec)]


def _export_expert_names(family: str) -> list[str]:
    # EP 2: two local experts per rank, exported for both ranks
    local = [f"mlp.experts.local_experts.{j}.{fc}.weight" for j in range(E // 2) for fc in ("linear_fc1", "linear_fc2")]
    return _export_names(family, local, ep=2)


def _recording_layer(layer_name: str, ckpt: tuple[str, str, str]):
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    calls = []

    def weight_loader(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        calls.append((param.name, expert_id, shard_id))
        return True

    layer = types.SimpleNamespace(layer_name=layer_name, moe_config=types.SimpleNamespace(is_act_and_mul=True))
    layer.get_expert_mapping = lambda include_fused=False: RoutedExperts.build_expert_params_mapping(
        *ckpt, num_experts=E, routed_experts_prefix="", include_fused=include_fused
    )
    for name in ("w13_weight", "w2_weight"):
        setattr(layer, name, types.SimpleNamespace(name=name, weight_loader=weight_loader))
    return layer, calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exported_expert_names_load_into_vllms_fused_experts(family):
    import importlib

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    cls_path, module, ckpt = FAMILIES[family]
    mod_name, cls_name = cls_path.split(".")
    mapper = getattr(importlib.import_module(f"vllm.model_executor.models.{mod_name}"), cls_name).hf_to_vllm_mapper
    names = _export_expert_names(family)
    assert len(names) == 3 * E and len(set(names)) == 3 * E  # every expert's gate, up, down, once
    prefix = f"model.layers.{LAYER}.{module}"
    shard_of = dict(zip(("gate", "up", "down"), ("w1", "w3", "w2"), strict=True))
    proj = {ckpt[0]: "gate", ckpt[2]: "up", ckpt[1]: "down"}
    for name in names:
        mapped = mapper.map_name(name)
        assert mapped == name and name.startswith(prefix + ".")  # the mapper leaves expert names alone
        expert, ckpt_name = name[len(prefix) + 1 :].split(".")[:2]
        layer, calls = _recording_layer(prefix, ckpt)
        loaded = list(RoutedExperts.load_weights(layer, [(name[len(prefix) + 1 :], torch.zeros(1))]))
        shard = shard_of[proj[ckpt_name]]
        param = "w2_weight" if shard == "w2" else "w13_weight"
        assert calls == [(param, int(expert), shard)] and loaded == [param], (name, calls)


def _cpu_kernel():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = object.__new__(CPUUnquantizedExperts)
    kernel.moe_config = types.SimpleNamespace(
        intermediate_size_per_partition=FFN, activation=MoEActivation.SILU, is_act_and_mul=True
    )
    return kernel


def _experts_layer(w13: torch.Tensor, w2: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(w13.clone(), requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(w2.clone(), requires_grad=False)
    return layer


def _fake_load_weights(model, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """What vLLM's expert weight_loader does at TP 1: each expert's gate / up / down into the
    rows of whatever fused parameter the layer holds now."""
    layer = model.experts
    for e in range(E):
        layer.w13_weight.data[e, :FFN].copy_(w13[e, :FFN])
        layer.w13_weight.data[e, FFN : 2 * FFN].copy_(w13[e, FFN:])
        layer.w2_weight.data[e, :, :FFN].copy_(w2[e])


def test_cpu_packed_experts_are_reloaded_in_place():
    from megatron_rl.platform.patches import vllm_cpu_weights

    vllm_cpu_weights.apply()
    gen = torch.Generator().manual_seed(0)
    old = [
        torch.randn(E, 2 * FFN, H, generator=gen, dtype=torch.bfloat16),
        torch.randn(E, H, FFN, generator=gen, dtype=torch.bfloat16),
    ]
    new = [torch.randn_like(t) for t in old]
    kernel = _cpu_kernel()
    model = torch.nn.Module()
    model.experts = _experts_layer(*old)
    kernel.process_weights_after_loading(model.experts)  # the engine's load: pad + prepack
    reference = _experts_layer(*new)
    kernel.process_weights_after_loading(reference)  # a fresh engine loading the new weights
    packed = [model.experts.w13_weight, model.experts.w2_weight]
    assert packed[0].shape == (E, 128, H) and not torch.equal(packed[0], reference.w13_weight)

    assert vllm_cpu_weights.expose_plain_experts(model) == 1
    assert model.experts.w13_weight.shape == (E, 2 * FFN, H)  # the plain, unpadded weights
    _fake_load_weights(model, *new)
    assert vllm_cpu_weights.repack(model) == 1
    assert model.experts.w13_weight is packed[0] and model.experts.w2_weight is packed[1]  # same storage
    assert torch.equal(model.experts.w13_weight, reference.w13_weight)
    assert torch.equal(model.experts.w2_weight, reference.w2_weight)
    # without exposing the plain weights, the same load writes plain rows into the packed layout
    _fake_load_weights(model, *old)
    assert vllm_cpu_weights.repack(model) == 0  # nothing exposed: nothing to repack
    stale = _experts_layer(*old)
    kernel.process_weights_after_loading(stale)
    assert not torch.equal(model.experts.w13_weight, stale.w13_weight)


SHARED = [f"mlp.shared_experts.{p}" for p in ("linear_fc1.weight", "linear_fc2.weight", "gate_weight")]


def _vllm_shared_expert_output(named_tensors, x):
    """A rank's body: vLLM's Qwen2-MoE shared expert and gate loaded from ``named_tensors`` through
    the model's mapper and ``AutoWeightsLoader``; (loaded names, its output on ``x``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.models.qwen2_moe import Qwen2MoeForCausalLM, Qwen2MoeMLP
    from vllm.model_executor.models.utils import AutoWeightsLoader

    from tests.hf_moe_models import tiny_moe_config

    cfg = tiny_moe_config("qwen2_moe", layers=2, experts=E)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method="env://", local_rank=0, backend="gloo"
        )
        initialize_model_parallel(1, 1)
        block = torch.nn.Module()  # the parameters of vLLM's Qwen2MoeSparseMoeBlock outside FusedMoE
        block.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False, quant_config=None)
        block.shared_expert = Qwen2MoeMLP(
            cfg.hidden_size,
            cfg.shared_expert_intermediate_size,
            cfg.hidden_act,
            reduce_results=False,
            expert_gate=block.shared_expert_gate,
        )
        root = torch.nn.Module()
        root.model = torch.nn.Module()
        root.model.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(LAYER + 1)])
        root.model.layers[LAYER].mlp = block
        loaded = AutoWeightsLoader(root).load_weights(named_tensors, mapper=Qwen2MoeForCausalLM.hf_to_vllm_mapper)
        for linear in (block.shared_expert_gate, block.shared_expert.gate_up_proj, block.shared_expert.down_proj):
            linear.quant_method.process_weights_after_loading(linear)
        with torch.no_grad():
            return sorted(loaded), block.shared_expert(x)


@pytest.mark.multiproc
def test_qwen2_moe_shared_expert_loads_into_vllm():
    from transformers import AutoModelForCausalLM

    from tests.distributed import run_distributed
    from tests.hf_moe_models import tiny_moe_config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_moe_config("qwen2_moe", layers=2, experts=E), dtype=torch.float32)
    hf_block = hf.model.layers[LAYER].mlp
    with torch.no_grad():
        for p in hf_block.parameters():
            p.normal_(0.0, 0.2)  # gate and up rows far apart: a swapped shard shows
    names = _export_names("qwen2_moe", SHARED)
    prefix = f"model.layers.{LAYER}.mlp."
    assert sorted(names) == [
        prefix + n
        for n in (
            "shared_expert.down_proj.weight",
            "shared_expert.gate_proj.weight",
            "shared_expert.up_proj.weight",
            "shared_expert_gate.weight",
        )
    ]
    tensors = {prefix + k: v.detach().clone() for k, v in hf_block.state_dict().items()}  # HF names: the export's
    x = torch.randn(5, hf.config.hidden_size)
    ((loaded, got),) = run_distributed(_vllm_shared_expert_output, 1, [(n, tensors[n]) for n in names], x)
    with torch.no_grad():
        want = torch.sigmoid(hf_block.shared_expert_gate(x)) * hf_block.shared_expert(x)
    assert loaded == [
        prefix + n
        for n in ("shared_expert.down_proj.weight", "shared_expert.gate_up_proj.weight", "shared_expert_gate.weight")
    ]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
