"""Upcycle a dense Llama HF checkpoint into a Mixtral-format mixture of experts.

Every expert of layer ``i`` starts as a copy of the dense MLP of layer ``i`` (``w1`` / ``w3`` /
``w2`` = ``gate_proj`` / ``up_proj`` / ``down_proj``); attention, norms and embeddings are
copied unchanged; each layer gets a router (``block_sparse_moe.gate``) of small random weights
(normal, ``router_std``, seeded) so routing is well defined and differs across tokens. Mixtral
renormalises its top-k weights to sum to one, so with identical experts the MoE output equals
the dense MLP's whatever the routes: the upcycled model computes the dense model's function
(up to float rounding) until training moves the experts apart.

The checkpoint is written in the canonical per-expert Mixtral layout (the names vLLM and
``models.moe`` read); tokenizer files, chat template and generation config are copied.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

# Dense Llama config keys carried over to the Mixtral config unchanged.
_COPIED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
    "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
    "attention_dropout", "rope_parameters", "rope_theta", "rope_scaling", "dtype", "torch_dtype",
)  # fmt: skip
_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)
_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_NAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def mixtral_config(dense: dict, *, num_experts: int, top_k: int) -> dict:
    """The Mixtral config.json of ``dense`` (a Llama config) upcycled to ``num_experts`` / ``top_k``."""
    if dense.get("model_type") != "llama":
        raise ValueError(f"upcycling needs a llama checkpoint, got model_type {dense.get('model_type')!r}")
    for key in ("attention_bias", "mlp_bias"):
        if dense.get(key):
            raise ValueError(f"HF config {key}=true: Mixtral has no such biases, cannot upcycle")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"experts per token must be in [1, {num_experts}], got {top_k}")
    out = {k: dense[k] for k in _COPIED_KEYS if k in dense}
    out.update(
        architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=num_experts,
        num_experts_per_tok=top_k, router_jitter_noise=0.0, output_router_logits=False,
        router_aux_loss_coef=0.0, sliding_window=None,
    )  # fmt: skip
    return out


def upcycled_tensors(
    dense: dict[str, torch.Tensor], *, num_experts: int, num_layers: int, router_std: float = 0.02, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Mixtral tensors from dense Llama ``dense`` (HF names): experts copy the MLP, routers random."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in dense.items():
        match = _MLP.match(name)
        if match is None:
            out[name] = tensor
            continue
        layer, proj = match.groups()
        for e in range(num_experts):  # separate storage: safetensors refuses shared tensors
            out[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{_EXPERT_NAME[proj]}.weight"] = tensor.clone()
    gen = torch.Generator().manual_seed(seed)
    hidden = dense["model.embed_tokens.weight"].shape[1]
    dtype = dense["model.embed_tokens.weight"].dtype
    for layer in range(num_layers):
        router = torch.randn(num_experts, hidden, generator=gen, dtype=torch.float32) * router_std
        out[f"model.layers.{layer}.block_sparse_moe.gate.weight"] = router.to(dtype)
    return out


def upcycle_checkpoint(
    dense_dir: str | Path,
    out_dir: str | Path,
    *,
    num_experts: int,
    top_k: int = 2,
    router_std: float = 0.02,
    seed: int = 0,
) -> int:
    """Write the Mixtral upcycling of the Llama checkpoint ``dense_dir`` to ``out_dir`` (an existing
    empty directory); returns the number of stored parameters."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    config = mixtral_config(dense_cfg, num_experts=num_experts, top_k=top_k)
    files = sorted(dense_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {dense_dir}")
    dense: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            dense.update({k: f.get_tensor(k) for k in f.keys()})
    tensors = upcycled_tensors(
        dense, num_experts=num_experts, num_layers=int(config["num_hidden_layers"]), router_std=router_std, seed=seed
    )
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in _SIDE_FILES:
        if (dense_dir / name).is_file():
            shutil.copy2(dense_dir / name, out_dir / name)
    return sum(t.numel() for t in tensors.values())
