"""Sequence weights you can see (issue 20): the ``mismatch/seq_weight_*`` metrics against
written-out values, the ``geometric_*`` correction modes against exp(mean δ), and the collapse
of the sequence product with length that motivates them (README's bf16 figures)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algorithms.correction import RolloutCorrection, mismatch_metrics, rollout_correction


def _padded(deltas: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trainer, behav, mask) ``[B, L]`` whose log-ratio on row i is ``deltas[i]`` (padding after)."""
    width = max(len(d) for d in deltas)
    behav = torch.full((len(deltas), width), -2.0)
    trainer, mask = behav.clone(), torch.zeros(len(deltas), width)
    for i, row in enumerate(deltas):
        trainer[i, : len(row)] += torch.tensor(row)
        mask[i, : len(row)] = 1
    trainer[mask == 0] = 123.0  # garbage in padding must not count
    return trainer, behav, mask


def test_sequence_weight_metrics_equal_the_written_out_values():
    deltas = [[0.1, -0.3], [-1.5, -1.1, 0.2], [0.0], [0.4, 0.4, 0.4, -0.1]]
    log = mismatch_metrics(*_padded(deltas)).to_log()
    weights = sorted(math.exp(sum(d)) for d in deltas)  # 0.0907, 0.819, 1.0, 3.004
    assert log["mismatch/n_tokens"] == 10
    assert log["mismatch/seq_weight_min"] == pytest.approx(weights[0], rel=1e-5)
    assert log["mismatch/seq_weight_median"] == pytest.approx(weights[1], rel=1e-5)  # torch: the lower middle
    assert log["mismatch/seq_weight_low_fraction"] == pytest.approx(1 / 4)


def test_metrics_merge_over_micro_batches_like_the_whole_batch():
    deltas = [[0.1, -0.3], [-1.5, -1.1, 0.2], [0.0], [0.4, 0.4, 0.4, -0.1], [-3.0]]
    whole = mismatch_metrics(*_padded(deltas)).to_log()
    parts = mismatch_metrics(*_padded(deltas[:2])).merge(mismatch_metrics(*_padded(deltas[2:]))).to_log()
    assert parts == pytest.approx(whole)


def test_no_measured_token_is_absent_not_a_perfect_match():
    trainer, behav, mask = _padded([[0.5, 0.5]])
    log = mismatch_metrics(trainer, behav, torch.zeros_like(mask)).to_log()
    assert log == {"mismatch/n_tokens": 0.0}


@pytest.mark.parametrize("kind", ["mask", "truncate"])
def test_geometric_mode_weights_by_exp_of_the_mean_log_ratio(kind):
    deltas = [[0.1, -0.3], [-1.5, -1.1, 0.2], [0.0], [0.4, 0.4, 0.4, -0.1]]
    trainer, behav, mask = _padded(deltas)
    settings = RolloutCorrection(mode=f"geometric_{kind}", c_min=0.5, c_max=1.2)
    out = rollout_correction(
        settings, trainer_logp=trainer, behav_logp=behav, logp=trainer, advantages=torch.ones(len(deltas)), mask=mask
    )
    for i, row in enumerate(deltas):
        r = math.exp(sum(row) / len(row))  # 0.905, 0.449, 1.0, 1.32
        expected = (r if 0.5 <= r <= 1.2 else 0.0) if kind == "mask" else min(max(r, 0.5), 1.2)
        assert out.weight[i, : len(row)].tolist() == pytest.approx([expected] * len(row), rel=1e-5)
        assert out.weight[i, len(row) :].abs().sum() == 0


def test_the_sequence_product_collapses_with_length_and_the_geometric_mean_does_not():
    """README's figures: engine log-probs with a per-token k3 of 1.4e-3 (a bf16 engine vs an fp32
    trainer): δ ~ N(-σ²/2, σ²) with k3 ≈ σ²/2 gives a median sequence weight of exp(-L k3)."""
    gen = torch.Generator().manual_seed(0)
    sigma = math.sqrt(2 * 1.4e-3)
    for length, median in ((256, 0.70), (2048, 0.057)):
        delta = (torch.randn(400, length, generator=gen) * sigma - sigma**2 / 2).tolist()
        trainer, behav, mask = _padded(delta)
        log = mismatch_metrics(trainer, behav, mask).to_log()
        assert log["mismatch/seq_weight_median"] == pytest.approx(median, rel=0.35)
        geo = torch.exp(torch.tensor(delta).mean(dim=1))
        assert geo.median().item() == pytest.approx(1.0, abs=0.01)
