"""LoRA checkpoints against the ``peft`` library (an independent implementation), at TP 1, TP 2
and PP 2: the adapter directory we write has the tensors, names, dtypes and config fields
``PeftModel.save_pretrained`` writes for the same adapters, and ``PeftModel.from_pretrained(hf
base, ours)`` gives our policy's logits (fp32, <= 1e-5 relative); an adapter directory peft
wrote loads into our policy; the merged checkpoint loaded by transformers gives peft's
``merge_and_unload`` logits."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_rl.lora import LoraSettings
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

RANK, ALPHA, DROPOUT = 4, 8.0, 0.05
PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", seed=3, layers=2)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(11))


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def peft_reference(checkpoint, input_ids, tmp_path_factory):
    """PEFT on the HF model with seeded random A and B, saved by ``save_pretrained``: (its
    directory, logits, logits of ``merge_and_unload``)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=PEFT_TARGETS, lora_dropout=DROPOUT, task_type="CAUSAL_LM"
    )
    model = get_peft_model(_hf(checkpoint), config).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    directory = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(directory)
    with torch.no_grad():
        logits = model(input_ids).logits
        merged = model.merge_and_unload()(input_ids).logits
    return directory, logits, merged


def _checkpoint_worker(tp, pp, path, peft_dir, out, input_ids):
    from megatron_rl.lora import apply_lora
    from megatron_rl.lora.checkpoint import load_peft_adapter, save_merged_checkpoint, save_peft_adapter
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.inference import forward_logits
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=tp, pp=pp)
    model, spec = load_model_from_hf(path)
    apply_lora(model, LoraSettings(rank=RANK, alpha=ALPHA, dropout=DROPOUT), spec)
    load_peft_adapter(model, peft_dir)  # peft's own files
    model.eval()
    logits = forward_logits(model, input_ids, vocab_size=spec.vocab_size)
    save_peft_adapter(model, out / "adapter", base_path=path)
    save_merged_checkpoint(model, spec, out / "merged", source_dir=path)
    return logits


def _relative(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def _tensors(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "adapter_model.safetensors"), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)])
def test_adapter_and_merged_checkpoints_match_peft(checkpoint, input_ids, peft_reference, tmp_path, tp, pp):
    from peft import PeftModel

    peft_dir, peft_logits, merged_logits = peft_reference
    for logits in run_distributed(_checkpoint_worker, tp * pp, tp, pp, str(checkpoint), peft_dir, tmp_path, input_ids):
        assert _relative(logits, peft_logits) <= RTOL  # peft's files loaded into our policy
    ours, theirs = _tensors(tmp_path / "adapter"), _tensors(peft_dir)
    assert ours[0] == theirs[0] == {"format": "pt"}
    assert sorted(ours[1]) == sorted(theirs[1])
    for key, value in theirs[1].items():
        assert ours[1][key].dtype == value.dtype and torch.equal(ours[1][key], value), key
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    reference = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(checkpoint)
    assert sorted(config.pop("target_modules")) == sorted(reference.pop("target_modules"))
    config.pop("base_model_name_or_path")
    assert {k: reference[k] for k in config} == config  # every field we write is peft's, same value
    loaded = PeftModel.from_pretrained(_hf(checkpoint), tmp_path / "adapter").eval()
    with torch.no_grad():
        assert _relative(loaded(input_ids).logits, peft_logits) <= RTOL
        merged = _hf(tmp_path / "merged")(input_ids).logits
    assert _relative(merged, merged_logits) <= RTOL
    assert _relative(merged_logits, peft_logits) <= RTOL  # dropout is off in eval: merged == adapted
    base = _hf(checkpoint)(input_ids).logits.detach()
    assert _relative(base, peft_logits) > 1e-3, "the adapters changed nothing: the test would not see a bug"


def test_load_refuses_other_settings(checkpoint, peft_reference, tmp_path):
    """A PEFT directory whose r / lora_alpha is not the model's is refused, naming the field."""
    (tmp_path / "adapter").mkdir()
    peft_dir = peft_reference[0]
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 3}))
    (tmp_path / "adapter" / "adapter_model.safetensors").write_bytes(
        (peft_dir / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(Exception, match="lora_alpha"):
        run_distributed(_checkpoint_worker, 1, 1, 1, str(checkpoint), tmp_path / "adapter", tmp_path, torch.ones(1, 4))
