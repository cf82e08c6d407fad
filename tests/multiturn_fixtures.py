"""A tiny chat model for multi-turn tests: a random char-level Llama (``models.synthetic``'s
tokenizer) with a chat template whose end-of-turn token is ``<eos>``, and an untied LM head
whose ``<eos>`` row points along the mean final hidden state, so random weights end their
turns after a few tokens (otherwise nearly every turn would run to max_new_tokens and end its
trajectory as truncated)."""

from __future__ import annotations

from pathlib import Path

# role initial, ':', content, <eos>; the generation header is 'a:' (prefix-stable, as
# environments.template requires).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def make_tiny_chat_model(path: Path, *, seed: int = 0, eos_logit: float = 10.0) -> Path:
    """Save the model of the module doc at ``path``; ``eos_logit``: the ``<eos>`` logit at a
    typical position (the others spread about ±4 with the wide head: most turns end within 2-11 tokens)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_rl.models.synthetic import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # wide head: varied samples (STACK-NOTES)
        probe = torch.randint(3, len(tokenizer), (8, 24))
        mean = model.model(probe).last_hidden_state.mean(dim=(0, 1))
        model.lm_head.weight[tokenizer.eos_token_id] = eos_logit * mean / mean.square().sum()
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
