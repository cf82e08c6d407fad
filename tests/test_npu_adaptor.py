"""The NPU adaptor path (issue 29, defect 3): on an Ascend NPU ``Tensor.type()`` reads
``torch.npu.FloatTensor``, which megatron-core's bf16 / distributed optimizer build and its grad
clipping refuse unless ``platform/patches/megatron_tensor_types`` renames it; tied embeddings at
PP > 1 run ``weight.data.cuda()`` on a PrivateUse1 device. Both are exercised on the emulated
device under its 910B profile (``emulated-npu``), which takes the same adaptor path as a real NPU
with the CPU redirects standing in for torch_npu's ``transfer_to_npu``.

The planted bug (the megatron patches applied on cpu / emulated only, as before this issue) must
fail the same run with megatron's own error.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("torch.npu.FloatTensor", "torch.cuda.FloatTensor"),
        ("torch.npu.BFloat16Tensor", "torch.cuda.BFloat16Tensor"),
        ("torch.emulated.HalfTensor", "torch.cuda.HalfTensor"),
        ("torch.FloatTensor", "torch.cuda.FloatTensor"),
        ("torch.cuda.FloatTensor", "torch.cuda.FloatTensor"),
    ],
)
def test_cuda_type_names(name, want):
    from megatron_rl.platform.patches.megatron_tensor_types import cuda_type_name

    assert cuda_type_name(name) == want


def _bf16_step(path, planted: bool) -> dict:
    """Rank body: PP 2 with tied embeddings, bf16 with fp32 master weights in the distributed
    optimizer, one optimizer step (grad clipping on) on the 910B profile."""
    import torch

    import megatron_rl.platform.patches.npu as npu_adaptor
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import chunk_by_tokens, make_micro_batch
    from megatron_rl.trainer.build import build_policy_trainer
    from tests.test_optimizer_resume import _settings
    from tests.test_policy_trainer import make_groups

    if planted:  # the defect: megatron's type checks patched on cpu / emulated only
        npu_adaptor.apply_megatron_patches = lambda device: None
    plat, _ = initialize_parallel(tp=1, pp=2, platform="emulated-npu")
    probe = torch.ones(2, device=plat.device)
    trainer, policy, spec = build_policy_trainer(_settings(path, "bfloat16", True))
    trainer.begin_batch()
    for chunk in chunk_by_tokens(make_groups(spec.vocab_size), 24):
        trainer.train_micro_batch(make_micro_batch(chunk, policy_version=0))
    result = trainer.finish_mini_batch()
    return {
        "type": probe.type(),
        "bf16": probe.bfloat16().type(),
        "skipped": result.skipped,
        "devices": sorted({str(p.device) for p in policy.parameters()}),
    }


@pytest.mark.multiproc
def test_bf16_distributed_optimizer_trains_on_the_npu_profile(tmp_path):
    path = make_tiny_hf(tmp_path / "hf", "llama", tied=True, layers=2)
    results = run_distributed(_bf16_step, 2, path, False)
    for rank, out in enumerate(results):
        assert out["type"] == "torch.npu.FloatTensor" and out["bf16"] == "torch.npu.BFloat16Tensor", out
        assert out["devices"] == [f"emulated:{rank}"], out
        assert not out["skipped"], out


@pytest.mark.multiproc
def test_without_the_megatron_patches_the_npu_profile_fails_like_a_910b(tmp_path):
    """Untied, so the run gets past the tied embedding's ``.cuda()`` to the optimizer build."""
    path = make_tiny_hf(tmp_path / "hf", "llama", tied=False, layers=2)
    with pytest.raises(RuntimeError, match=r"Wrapped parameters must be one of .*Received torch\.npu\.BFloat16Tensor"):
        run_distributed(_bf16_step, 2, path, True)
