"""``platform/patches/cross_entropy_sync``: megatron's vocab-parallel ``calculate_predicted_logits``
without boolean-mask writes returns exactly what megatron's own returns (the reference: the
unpatched static method, kept before the patch), for a TP rank's vocabulary slice that holds some
targets and not others, and reads nothing back to the host on the device (megatron's does)."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

from megatron_rl.platform import emulated
from megatron_rl.platform.patches.cross_entropy_sync import calculate_predicted_logits

MEGATRONS = VocabParallelCrossEntropy.__dict__["calculate_predicted_logits"].__func__


def _inputs(device, start: int, end: int):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, end - start, generator=g)
    target = torch.randint(0, 3 * (end - start), (2, 7), generator=g)  # most outside [start, end)
    return logits.to(device), target.to(device), logits.max(dim=-1)[0].to(device)


@pytest.mark.parametrize(("start", "end"), [(0, 16), (16, 32), (32, 48)])
def test_equals_megatrons_calculate_predicted_logits(device, start, end):
    if MEGATRONS is calculate_predicted_logits:
        pytest.skip("megatron's method was already patched in this process")
    logits, target, logits_max = _inputs(device, start, end)
    inside = ((target >= start) & (target < end)).cpu()
    assert inside.any() and not inside.all()  # both branches of the mask are exercised
    before = emulated.transfer_counts()
    want = MEGATRONS(logits.clone(), target, logits_max, start, end)
    middle = emulated.transfer_counts()
    got = calculate_predicted_logits(logits.clone(), target, logits_max, start, end)
    after = emulated.transfer_counts()
    for name, w, g in zip(
        ("target_mask", "masked_target_1d", "predicted_logits", "sum_exp_logits", "exp_logits"), want, got, strict=True
    ):
        assert g.device == device and g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), name
    assert (middle - before).syncs >= 1, "megatron's boolean-mask writes were expected to sync"
    assert (after - middle).syncs == 0 and (after - middle).d2h == 0
