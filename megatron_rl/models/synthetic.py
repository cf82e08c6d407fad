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


def write_char_llama(path: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int = 2,
                     seed: int = 0) -> Path:
    """Save a random Llama (head_dim = hidden / heads) with the char tokenizer at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = char_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    path = Path(path)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
