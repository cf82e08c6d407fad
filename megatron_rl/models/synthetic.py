"""Tiny random checkpoints that need nothing from a hub: a character-level tokenizer and a
small Llama over its vocabulary, saved as a normal HF directory. For benchmarks and tests
that exercise the whole RL loop (tokenize -> generate -> detokenize -> score -> train) in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHARS = list("0123456789+-*/=()., ?!:;'\"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n\\{}")
SPECIALS = ["<pad>", "<eos>", "<unk>"]


def char_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` (vocabulary: SPECIALS + CHARS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def write_char_llama(
    path: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 2, seed: int = 0
) -> Path:
    """Save a random Llama (head_dim = hidden / heads) with the char tokenizer at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    path = Path(path)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_char_moe(
    path: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    experts: int = 4,
    top_k: int = 2,
    seed: int = 0,
    router_std: float = 0.5,
    expert_std: float = 0.2,
) -> Path:
    """Save a random Qwen3-MoE (head_dim 32, every layer sparse) with the char tokenizer at ``path``.
    ``router_std``: the routers' init scale (wide: clear top-k margins between experts);
    ``expert_std``: the experts' (large: which expert a token takes changes its output)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tokenizer = char_tokenizer()
    cfg = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            elif ".experts." in name:
                p.normal_(0.0, expert_std)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
