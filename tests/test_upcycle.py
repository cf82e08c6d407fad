"""Upcycling a dense Llama into a Mixtral MoE (``models.upcycle``, ``tools/prepare_model.py
--upcycle-experts``): the upcycled model's transformers logits equal the dense model's (identical
experts, renormalised top-k), while its routers do route tokens to different experts.

A tiny random Llama stands in for SmolLM2 (same architecture, tied embeddings, GQA); the real
conversion is the same code on a bigger checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from megatron_rl.models.hf_config import decoder_spec_from_hf

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("prepare_model", ROOT / "tools" / "prepare_model.py")
prepare = importlib.util.module_from_spec(_spec)
sys.modules["prepare_model"] = prepare
_spec.loader.exec_module(prepare)

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    model = LlamaForCausalLM(cfg).to(torch.float32)
    out = tmp_path_factory.mktemp("dense")
    model.save_pretrained(out)
    (out / "chat_template.jinja").write_text(TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    (out / "tokenizer.json").write_text("{}")
    return out


def test_upcycled_logits_equal_the_dense_model(dense_dir, tmp_path):
    out = tmp_path / "moe"
    made = prepare.prepare_model(
        out_dir=out, dtype="float32", upcycle_experts=4, experts_per_tok=2, dense_dir=dense_dir
    )
    assert not made.skipped and made.n_params > 0
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_local_experts"], config["num_experts_per_tok"]) == ("mixtral", 4, 2)
    assert (out / "chat_template.jinja").read_text() == TEMPLATE  # tokenizer side files copied
    spec = decoder_spec_from_hf(config)  # our loader accepts it as a 4-expert Mixtral
    assert spec.moe is not None and spec.moe.num_experts == 4 and spec.tie_word_embeddings

    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(moe).__name__ == "MixtralForCausalLM"
    dense_params = sum(p.numel() for p in dense.parameters())
    mlp = sum(p.numel() for n, p in dense.named_parameters() if ".mlp." in n)
    assert made.n_params == dense_params + 3 * mlp + 3 * 4 * 64  # 3 more expert copies + 3 routers
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = dense(ids).logits
        got = moe(ids, output_router_logits=True)
    assert (got.logits - expected).abs().max().item() < 1e-5
    top1 = torch.cat([r.reshape(-1, 4) for r in got.router_logits]).argmax(-1)
    assert top1.unique().numel() > 1  # the routers are not degenerate: tokens go to different experts


def test_existing_output_is_reused_or_refused(dense_dir, tmp_path):
    out = tmp_path / "moe"
    prepare.prepare_model(out_dir=out, dtype="float32", upcycle_experts=2, experts_per_tok=1, dense_dir=dense_dir)
    again = prepare.prepare_model(out_dir=out, dtype="float32", upcycle_experts=2, dense_dir=dense_dir)
    assert again.skipped
    with pytest.raises(ValueError, match="2 experts, asked for 4"):
        prepare.prepare_model(out_dir=out, dtype="float32", upcycle_experts=4, dense_dir=dense_dir)
    with pytest.raises(ValueError, match="experts per token"):
        prepare.prepare_model(
            out_dir=tmp_path / "bad", dtype="float32", upcycle_experts=2, experts_per_tok=3, dense_dir=dense_dir
        )
