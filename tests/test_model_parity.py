"""Megatron-core models built from HF checkpoints equal HF transformers (logits and log-probs)
at TP=1, TP=2, PP=2 and TP=2 x PP=2; HF -> megatron -> HF export is bit-exact; one training
step at TP=2 updates the weights exactly as at TP=1."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import hf_logits, make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

VARIANTS = {
    "llama": ("llama", False),
    "llama_tied": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        name: make_tiny_hf(root / name, fam, tied=tied, seed=i)
        for i, (name, (fam, tied)) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))


def _parity_worker(tp, pp, paths, input_ids, export_dir):
    from megatron_rl.models import load_model_from_hf, save_hf_checkpoint
    from megatron_rl.parallel.inference import forward_logits, forward_logprobs
    from megatron_rl.parallel.state import initialize_parallel

    initialize_parallel(tp=tp, pp=pp)
    out = {}
    for name, path in paths.items():
        model, spec = load_model_from_hf(path)
        model.eval()
        logits = forward_logits(model, input_ids, vocab_size=spec.vocab_size)
        logprobs = forward_logprobs(model, input_ids, vocab_size=spec.vocab_size, temperature=0.7)
        out[name] = (logits, logprobs)
        if export_dir is not None:
            save_hf_checkpoint(model, spec, f"{export_dir}/{name}", source_dir=path)
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logits_and_logprobs_match_hf(checkpoints, input_ids, tmp_path, tp, pp):
    export = str(tmp_path) if (tp, pp) == (2, 2) else None
    results = run_distributed(
        _parity_worker, tp * pp, tp, pp, {k: str(v) for k, v in checkpoints.items()}, input_ids, export
    )
    for name, path in checkpoints.items():
        ref = hf_logits(path, input_ids)
        ref_lp = torch.log_softmax(ref[:, :-1] / 0.7, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
        for rank, per_rank in enumerate(results):
            logits, logprobs = per_rank[name]
            assert logits.shape == ref.shape
            assert (logits - ref).abs().max() <= 1e-4, f"{name} tp={tp} pp={pp} rank={rank}"
            assert (logprobs - ref_lp).abs().max() <= 1e-4, f"{name} tp={tp} pp={pp} rank={rank}"
    if export is not None:
        from safetensors.torch import load_file

        from megatron_rl.models import HFCheckpointReader

        for name, path in checkpoints.items():
            original = load_file(path / "model.safetensors")
            exported = HFCheckpointReader(tmp_path / name)
            assert sorted(original) == exported.names(), name
            for key, tensor in original.items():
                assert torch.equal(tensor, exported(key)), f"{name}: {key} differs after round trip"
            assert (tmp_path / name / "config.json").is_file()


def _train_step_worker(tp, path, input_ids):
    from megatron_rl.config.schema import TrainerConfig
    from megatron_rl.models import export_hf_tensors, load_model_from_hf
    from megatron_rl.parallel.schedule import run_schedule
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs
    from megatron_rl.trainer.optim import wrap_for_training

    initialize_parallel(tp=tp, pp=1)
    model, spec = load_model_from_hf(path)
    # A large eps keeps Adam's first step (~lr * sign(g)) from amplifying rounding noise of ~0 grads.
    ddp, optimizer = wrap_for_training(model, TrainerConfig(steps=1, lr=1e-2, grad_clip=0.5, adam_eps=1e-3))
    ddp.zero_grad_buffer()
    optimizer.zero_grad()

    def loss(logits, ids):
        lp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=spec.vocab_size)
        return -lp.mean(), lp.detach()

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    run_schedule(
        ddp,
        [input_ids],
        forward_step=lambda m, ids: m(ids, positions, attention_mask=None),
        loss=loss,
        seq_length=lambda ids: ids.shape[1],
        forward_only=False,
    )
    ok, grad_norm, _ = optimizer.step()
    assert ok
    return {n: t.clone() for n, t in export_hf_tensors(model, spec)}, float(grad_norm)


def test_train_step_tp2_equals_tp1(checkpoints, input_ids):
    path = str(checkpoints["qwen2"])
    ((ref, ref_norm),) = run_distributed(_train_step_worker, 1, 1, path, input_ids)
    results = run_distributed(_train_step_worker, 2, 2, path, input_ids)
    from safetensors.torch import load_file

    before = load_file(checkpoints["qwen2"] / "model.safetensors")
    moved = max((ref[k] - before[k]).abs().max().item() for k in ref)
    assert moved > 1e-3, "the optimizer step did not change the weights"
    for tensors, norm in results:
        assert abs(norm - ref_norm) <= 1e-4 * ref_norm
        for key, value in ref.items():
            torch.testing.assert_close(tensors[key], value, atol=1e-5, rtol=1e-5, msg=key)
