"""MoE models built by megatron-core from HF checkpoints equal HF transformers at expert-parallel
layouts in one world of 4 ranks: TP1 x EP2 (DP 4), TP2 x EP2 and PP2 x EP2 (logits and
log-probs within the dense path's 1e-4); Qwen3-MoE at every layout, Qwen2-MoE (shared expert)
and Mixtral at TP2 x EP2; the export at TP2 x EP2 gives back every HF tensor bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import hf_logits
from tests.hf_moe_models import MOE_FAMILIES, make_tiny_moe

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

LAYOUTS = ((1, 1, 2), (2, 1, 2), (1, 2, 2))  # (tp, pp, ep) in a world of 4


def _layouts_worker(paths, input_ids, export_dir):
    from megatron_rl.models import load_model_from_hf, save_hf_checkpoint
    from megatron_rl.parallel.inference import forward_logits, forward_logprobs
    from megatron_rl.parallel.state import destroy_parallel, initialize_parallel

    out = {}
    for tp, pp, ep in LAYOUTS:
        initialize_parallel(tp=tp, pp=pp, ep=ep, platform="cpu")
        for name, path in paths.items():
            if name != "qwen3_moe" and (tp, pp) != (2, 1):
                continue
            model, spec = load_model_from_hf(path)
            model.eval()
            out[name, tp, pp, ep] = (
                forward_logits(model, input_ids, vocab_size=spec.vocab_size),
                forward_logprobs(model, input_ids, vocab_size=spec.vocab_size, temperature=0.7),
            )
            if (tp, pp) == (2, 1):
                save_hf_checkpoint(model, spec, f"{export_dir}/{name}", source_dir=path)
        destroy_parallel(keep_world=True)
    return out


def test_moe_layouts_match_hf_and_export_bit_exact(tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.models import HFCheckpointReader

    paths = {f: make_tiny_moe(tmp_path / f, f, seed=i, layers=2) for i, f in enumerate(MOE_FAMILIES)}
    input_ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))
    results = run_distributed(
        _layouts_worker, 4, {k: str(v) for k, v in paths.items()}, input_ids, str(tmp_path / "export"), timeout_s=600
    )
    for name, path in paths.items():
        ref = hf_logits(path, input_ids)
        ref_lp = torch.log_softmax(ref[:, :-1] / 0.7, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
        runs = [(key, r[key]) for r in results for key in r if key[0] == name]
        assert len(runs) == 4 * (len(LAYOUTS) if name == "qwen3_moe" else 1)
        for key, (logits, logprobs) in runs:
            assert (logits - ref).abs().max() <= 1e-4, key
            assert (logprobs - ref_lp).abs().max() <= 1e-4, key
        original, exported = load_file(path / "model.safetensors"), HFCheckpointReader(tmp_path / "export" / name)
        assert sorted(original) == exported.names(), name
        for key, tensor in original.items():
            assert torch.equal(tensor, exported(key)), f"{name}: {key} differs after export at TP2 x EP2"
