"""The loss path keeps to the 910B's device rules (issue 29, defects 1, 2 and 9's host sync).

- No float64 on the device: CANN computes no DOUBLE (its expm1 takes none) and torch_npu's HCCL
  all-reduce refuses kDouble. fp64 is for host tensors only.
- Batch counts are exact integers (int64: HCCL all-reduces it), never fp32 (exact only to 2^24).
- No data-dependent shape and no scalar read per micro-batch: each is a hidden device -> host
  sync (``correction.mismatch_metrics`` indexed the per-sequence weights with a boolean mask).

The rules are checked op by op by ``tests.device_op_rules.DeviceOpRecorder`` on the emulated
device, independently of the device's own profile. Precision where fp64 was used for it (k3 of
tiny log-ratios) is checked against exact decimal arithmetic on the host.
"""

from __future__ import annotations

import decimal

import pytest
import torch

from megatron_rl.algorithms import LossSettings, RolloutCorrection, loss_denominator, policy_loss
from megatron_rl.algorithms.correction import MismatchMetrics, k3_of_log_ratio, mismatch_metrics
from megatron_rl.algorithms.metrics import LossMetrics
from megatron_rl.trainer.world_metrics import to_host
from tests.device_op_rules import DeviceOpRecorder


def _exact_k3(x: float) -> float:
    """exp(x) − 1 − x in 60-digit decimal arithmetic, rounded once to a float."""
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        d = decimal.Decimal(x)
        return float(d.exp() - 1 - d)


def test_k3_in_fp32_is_as_accurate_as_the_exact_value_rounded():
    magnitudes = torch.cat(
        [
            torch.logspace(-10, -2, 300, dtype=torch.float64),  # k3 ≈ δ²/2: fp32 cancels
            torch.linspace(0.01, 3.0, 300, dtype=torch.float64),  # across the series' edge (1)
            torch.tensor([1 - 1e-6, 1.0, 1 + 1e-6, 10.0, 30.0, 80.0], dtype=torch.float64),
        ]
    )
    delta = torch.cat([magnitudes, -magnitudes]).float()  # the fp32 values are the inputs
    exact = torch.tensor([_exact_k3(x) for x in delta.tolist()], dtype=torch.float64)
    got = k3_of_log_ratio(delta)
    assert got.dtype == torch.float32
    rel = (got.double() - exact).abs() / exact
    assert rel.max() <= 5e-7, f"relative error {rel.max():.2e} at δ = {delta[rel.argmax()]:.3e}"
    naive = (torch.expm1(delta) - delta).double()  # what plain fp32 would give: useless for tiny δ
    assert ((naive - exact).abs() / exact).max() > 0.5


def test_recorder_sees_each_rule(device):
    """The checker itself: a planted fp64 op, fp64 all-reduce operand, mask index, scalar read."""
    x = torch.arange(6.0, device=device)
    with DeviceOpRecorder() as rec:
        x.double().sum()
        x[x > 2].sum()
        x.nonzero()
        x.index_put_((x > 100,), torch.tensor(0.0))  # ATen's masked fill: no data-dependent shape
        float(x.sum())
        x.cpu().double()  # fp64 on the host is fine
    assert rec.fp64 and rec.host_reads == ["aten._local_scalar_dense.default"]
    assert rec.data_dependent == ["aten.index.Tensor", "aten.nonzero.default"]


B, L = 4, 9


def _batch(device):
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 3, 0, 6])  # an empty row: no counted token
    mask = torch.arange(L)[None] < lengths[:, None]
    logp = -torch.rand(B, L, generator=g) * 2
    delta = torch.randn(B, L, generator=g) * torch.tensor([1e-6, 1e-3, 0.1, 0.5])[:, None]  # tiny to large
    behav = logp - delta
    behav[0, 4] = float("nan")  # a non-finite engine log-prob: dropped, counted
    versions = torch.tensor([3, 2, 3, 1])[:, None].expand(B, L)
    tensors = {
        "logp": logp,
        "old_logp": logp + 0.01 * torch.randn(B, L, generator=g),
        "ref_logp": logp - 0.05,
        "behav_logp": behav,
        "entropy": torch.rand(B, L, generator=g),
        "mask": mask,
        "advantages": torch.tensor([1.0, -0.5, 0.3, -1.2]),
        "versions": versions,
    }
    return {k: v.to(device) for k, v in tensors.items()}


SETTINGS = [
    LossSettings(kind="grpo", kl_coef=0.1, correction=RolloutCorrection(mode="token_truncate", c_max=2.0)),
    LossSettings(
        kind="dapo",
        clip_high=0.28,
        entropy_coef=0.01,
        correction=RolloutCorrection(mode="sequence_mask", c_min=0.5, c_max=2.0, delta=0.05),
    ),
    LossSettings(
        kind="dr_grpo", max_response_len=L, correction=RolloutCorrection(mode="geometric_mask", c_min=0.9, c_max=1.1)
    ),
    LossSettings(
        kind="ppo_decoupled",
        proximal="recompute",
        behav_weight_cap=5.0,
        correction=RolloutCorrection(mode="token_mask", c_min=0.5, c_max=2.0, delta=0.1),
    ),
]


def _micro_batch(settings: LossSettings, t: dict[str, torch.Tensor]):
    """One micro-batch as the trainer runs it: its share of D, then the loss against the engine."""
    share = loss_denominator(settings, t["mask"])
    out = policy_loss(settings, denominator=1.0, current_version=3, **t)
    return share, out


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.kind}-{s.correction.mode}")
def test_a_loss_and_correction_micro_batch_keeps_to_the_device_rules(device, settings):
    t = _batch(device)
    t["logp"].requires_grad_()
    with DeviceOpRecorder() as rec:
        share, out = _micro_batch(settings, t)
        out.loss.backward()
    assert rec.violations() == {}
    assert share.dtype == torch.int64 and share.device == device
    assert out.metrics.mismatch is not None and out.metrics.mismatch.seq_measured.device == device


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.kind}-{s.correction.mode}")
def test_a_micro_batch_runs_under_the_emulated_910b_profile(device, settings):
    """The emulated device's npu profile refuses fp64 compute on the device by itself."""
    from megatron_rl.platform import emulated

    t = _batch(device)
    t["logp"].requires_grad_()
    with emulated.profile("npu"):
        share, out = _micro_batch(settings, t)
        out.loss.backward()
        host = to_host(out.metrics.merge(out.metrics))
    assert int(share.cpu()) > 0 and host.mismatch is not None


def test_a_decoupled_a3po_micro_batch_computes_no_fp64_and_no_data_dependent_shape(device):
    """A-3PO (``proximal: loglinear``): the version check in ``loglinear_proximal_logp`` reads one
    flag per micro-batch (left as it is: see the report); no other rule is broken."""
    settings = LossSettings(
        kind="ppo_decoupled",
        proximal="loglinear",
        correction=RolloutCorrection(mode="token_mask", c_min=0.5, c_max=2.0, delta=0.1),
    )
    with DeviceOpRecorder() as rec:
        _micro_batch(settings, _batch(device))
    assert rec.violations(host_reads=False) == {}


def test_counts_are_exact_int64_past_fp32s_range(device):
    """2^24 + 1 tokens: fp32 would round the count to 2^24."""
    n = 2**24 + 1
    mask = torch.ones(1, n, dtype=torch.bool, device=device)
    for kind, expected in (("dapo", n), ("grpo", 1), ("bnpo", n)):
        share = loss_denominator(LossSettings(kind=kind), mask)
        assert share.dtype == torch.int64 and int(share.cpu()) == expected


def test_mismatch_metrics_and_their_host_copy_equal_an_fp64_host_computation(device):
    t = _batch(device)
    trainer, behav, mask = t["old_logp"], t["behav_logp"], t["mask"]
    with DeviceOpRecorder() as rec:
        metrics = mismatch_metrics(trainer, behav, mask)
        merged = metrics.merge(metrics)  # two micro-batches
    assert rec.violations() == {}
    host = to_host(merged)
    assert all(v.device.type == "cpu" for v in _values(host))
    # independent: fp64 on the host, per counted finite token, the measured sequences by hand
    tr, be, m = (x.cpu().double() for x in (trainer, behav, mask))
    ok = m.bool() & torch.isfinite(be)
    d = torch.where(ok, tr - be, 0.0)
    k3 = torch.tensor([_exact_k3(x) for x in d[ok].tolist()], dtype=torch.float64)
    assert float(host.kl_k3_sum) == pytest.approx(2 * float(k3.sum()), rel=1e-6)
    assert float(host.abs_diff_sum) == pytest.approx(2 * float(d.abs().sum()), rel=1e-6)
    log = host.to_log()
    seq = torch.exp(d.sum(-1))[m.bool().any(-1)]  # the three rows with a counted token, twice
    assert log["mismatch/seq_weight_min"] == pytest.approx(float(seq.min()), rel=1e-6)
    assert log["mismatch/seq_weight_median"] == pytest.approx(float(torch.cat([seq, seq]).median()), rel=1e-6)


def _values(metrics) -> list[torch.Tensor]:
    out = []
    for name in metrics.__dataclass_fields__:
        value = getattr(metrics, name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (LossMetrics, MismatchMetrics)):
            out.extend(_values(value))
    return out


def test_to_host_widens_nothing_on_the_device_and_keeps_each_dtype(device):
    t = _batch(device)
    out = policy_loss(SETTINGS[1], denominator=1.0, current_version=3, **t)
    metrics = out.metrics.merge(out.metrics)
    with DeviceOpRecorder() as rec:
        host = to_host(metrics)
    assert rec.violations(host_reads=False) == {}
    for before, after in zip(_values(metrics), _values(host), strict=True):
        assert after.device.type == "cpu" and after.dtype == before.dtype
        assert torch.equal(after, before.cpu())
