"""Token in / token out through chat templates: a multi-turn trajectory assembled from
`prompt_ids`, the model's own ids and `observation_ids` equals, id for id, the chat template's
rendering of the whole conversation (transformers' `apply_chat_template`, the independent side),
for the SmolLM2, Qwen2.5, Qwen3 and Llama-3.x templates (shipped by TRL), on a byte-level
tokenizer and on SmolLM2's real BPE tokenizer when it is prepared; templates that cannot be used
raise `TemplateError`; the <tool_call> parser."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megatron_rl.environments.template import (
    TemplateError,
    end_of_turn_id,
    observation_ids,
    parse_tool_calls,
    prompt_ids,
    renders_tools,
    with_tools,
)

SMOLLM2 = Path(__file__).resolve().parents[1] / ".cache/models/smollm2-135m-instruct"
# TRL ships the original templates of these models; found without importing trl (slow).
TRL_TEMPLATES = Path(importlib.util.find_spec("trl").submodule_search_locations[0]) / "chat_templates"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# SmolLM2-135M-Instruct's template (as tools/prepare_model.py writes it): ChatML, no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = (
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
)
TURNS = (
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>',
    "So it is 56088. Are you sure?",
)
OBSERVATIONS = ([{"role": "tool", "content": "56088"}], [{"role": "user", "content": "Check again."}])


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges (every byte a token) with the templates' special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", additional_special_tokens=SPECIAL)


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, object]:
    out = {"bytes": byte_tokenizer()}
    if (SMOLLM2 / "tokenizer.json").is_file():
        out["smollm2"] = AutoTokenizer.from_pretrained(SMOLLM2)
    return out


def _template(name: str) -> str:
    return SMOLLM2_TEMPLATE if name == "smollm2" else (TRL_TEMPLATES / f"{name}.jinja").read_text()


# Llama-3 templates on SmolLM2's BPE would merge the header's "\n\n" with the content's first
# letter (Llama-3's own tokenizer does not): they run on the byte-level tokenizer only.
@pytest.mark.parametrize(
    ("template", "tokenizer"),
    [
        ("smollm2", "bytes"),
        ("smollm2", "smollm2"),
        ("qwen2_5", "bytes"),
        ("qwen2_5", "smollm2"),
        ("qwen3", "bytes"),
        ("qwen3", "smollm2"),
        ("llama3_1", "bytes"),
        ("llama3_2", "bytes"),
    ],
)
def test_trajectory_ids_equal_the_template_rendering(tokenizers, template, tokenizer):
    if tokenizer not in tokenizers:
        pytest.skip(f"{SMOLLM2} not prepared (python tools/prepare_model.py)")
    tok = tokenizers[tokenizer]
    tok.chat_template = _template(template)
    assert renders_tools(tok) == (template != "smollm2")
    conversation = [{"role": "user", "content": "What is 123*456?"}]
    ids = list(prompt_ids(tok, conversation, TOOLS))
    eot = end_of_turn_id(tok, TOOLS)
    for text, observation in zip(TURNS, OBSERVATIONS, strict=True):
        ids += [*tok(text, add_special_tokens=False)["input_ids"], eot]  # what an engine returns
        ids += observation_ids(tok, observation, TOOLS)
        conversation += [{"role": "assistant", "content": text}, *observation]
    messages, tools = with_tools(tok, conversation, TOOLS)
    expected = tok.apply_chat_template(
        messages, tools=tools or None, tokenize=True, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    assert ids == list(expected)
    assert "calculator" in tok.decode(ids[: 20 + len(ids) // 2])  # the tool schema is in the prompt


def test_observation_ids_of_smollm2(tokenizers):
    tok = tokenizers["bytes"]
    tok.chat_template = SMOLLM2_TEMPLATE
    ids = observation_ids(tok, [{"role": "tool", "content": "42"}], TOOLS)
    assert tok.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(end_of_turn_id(tok)) == "<|im_end|>"


@pytest.mark.parametrize(
    ("template", "words"),
    [
        # the generation header is not how the template starts an assistant turn it renders
        (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\nSure:{% endif %}",
            "not prefix-stable",
        ),
        # an assistant turn closed by plain text, not one end-of-turn token
        (
            "{% for m in messages %}### {{ m.role }}: {{ m.content }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant: {% endif %}",
            "end-of-turn token",
        ),
    ],
)
def test_unusable_templates_raise(tokenizers, template, words):
    tok = byte_tokenizer()
    tok.chat_template = template
    with pytest.raises(TemplateError, match=words):
        observation_ids(tok, [{"role": "tool", "content": "1"}], ())


def test_parse_tool_calls():
    text = (
        'a <tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call> b '
        '<tool_call>\n{"name": "calc", "arguments": "{\\"x\\": 2}"}\n</tool_call>'
        '<tool_call>{"name": 3}</tool_call><tool_call>{nope}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": [1]}</tool_call><tool_call>{"name": "calc"'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calc", {"x": 1}), ("calc", {"x": 2})]
    assert [c.error is None for c in calls] == [True, True, False, False, False, False]
    assert "not closed" in calls[-1].error and "JSON" in calls[3].error
    assert parse_tool_calls("no calls here") == []
    raw = '<tool_call>{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}</tool_call>'  # a raw newline
    assert parse_tool_calls(raw)[0].arguments == {"code": "x = 1\nprint(x)"}
