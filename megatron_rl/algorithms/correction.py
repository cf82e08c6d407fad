"""Training–inference mismatch: TRL's rollout importance-sampling correction, DeepSeek-V3.2
off-policy sequence masking, the mismatch metrics and the alarm that gates the optimizer step.

Contract: pure tensor functions, no process groups. Per-token tensors are padded ``[B, L]``
with ``mask [B, L]`` (1 = response token that counts); ``advantages`` are ``[B]``.

Log-probs. ``behav_logp`` is what the rollout engine reported for the sampled token (the
sampled-from distribution, after temperature and top-p: see ``rollout/sampling.py``);
``trainer_logp`` is the trainer's log-prob of the same token under the same weights: the old
policy (θ at the iteration's start), or the detached policy where the old policy is not
computed (one optimizer step per batch: the policy before the step). Padding may hold
anything; it never enters a result.

Correction (``mode``), exactly TRL ``GRPOTrainer``'s ``vllm_importance_sampling_*``:

- per-token log-ratio δ_t = log π_trainer − log π_behav on counted tokens, 0 elsewhere (NaN → 0);
- ``token_*``: r_t = exp(δ_t); ``sequence_*``: r = exp(Σ_t δ_t) (a sum, not a mean), shared by
  the sequence's tokens; ``geometric_*``: r = exp(mean_t δ_t) over the sequence's counted tokens
  (verl's geometric level): the sequence product collapses with length (at a per-token k3 of
  1.4e-3, a bf16 engine's, its median is 0.63 at 256 tokens and 0.04 at 2k), the geometric mean
  does not;
- ``*_truncate``: w = clamp(r, C_min, C_max); ``*_mask``: w = r inside [C_min, C_max], else 0
  (a missing bound is ±∞); ``none``: w = 1.

Off-policy sequence masking (DeepSeek-V3.2 eq. 9, TRL's ``off_policy_mask_threshold``): with
the policy being trained π_θ (detached),

    KL_i = Σ_t m_t (log π_behav − log π_θ) / max(Σ_t m_t, 1)      (k1, sequence mean)
    keep_i = (A_i ≥ 0) or (KL_i ≤ δ)

and the sequence's weight is multiplied by keep_i.

How the weight enters the loss (``losses.policy_loss``): it multiplies the clipped policy term
per token, as TRL does; KL and entropy terms are not reweighted, and dropped tokens still count
in the loss denominator (TRL, AReaL). For ``ppo_decoupled`` the decoupled behaviour weight
π_prox / π_behav already is the importance weight towards the behaviour policy (with
``proximal: recompute`` and fresh samples it is exactly TRL's token ratio π_old / π_behav), so
multiplying a second ratio would count the correction twice. There the correction only
*masks*: the tokens / sequences a ``*_mask`` mode or δ drops are removed, the behaviour
weight is kept as the one weight (bounded by ``behav_weight_cap``), and ``*_truncate`` modes
are refused (bound the behaviour weight with ``behav_weight_cap`` instead). Only tokens sampled
by the weights the trainer holds (staleness 0) have a same-weights comparison: ``policy_loss``
passes them as ``measured``; stale tokens (stale mode, d ≥ 1) get no ratio and no measurement
(the decoupled behaviour weight owns them; ``trainer.engine_probe`` measures the engine in
stale mode), but δ masking, which needs only π_θ and π_behav, applies to them as to fresh ones.
Staleness is per token: with in-flight weight updates one response spans versions
(``Sample.token_versions``), and only its tokens of the trainer's version are measured.

Non-finite behaviour log-probs (NaN / ±inf from the engine) are no measurement, and never a
match: such a token gets δ_t = 0 like padding (it must not reach an exp), is dropped (weight 0,
in every mode, ``none`` included; ``losses.policy_loss`` keeps it out of the loss), is counted in
``nonfinite_behav``, and any count > 0 is over every ``mismatch_alarm`` (``alarm_verdict``).
Here we part from TRL, which reads a NaN sampling log-prob as ratio 1 ("unavailable from vLLM").

Metrics (``MismatchMetrics``, over counted tokens, mergeable like ``LossMetrics``):
``logprob_abs_diff_mean / max`` of |log π_trainer − log π_behav|, ``kl_k3`` the token mean of
Schulman's k3 estimate of KL(π_behav ‖ π_trainer), ``seq_ratio_max`` the largest sequence ratio
exp(Σ_t δ_t) (before bounding), ``masked_fraction`` the counted tokens the correction dropped,
``nonfinite_behav`` the counted tokens whose behaviour log-prob is not finite (a count; they add 0
to the sums and maxima, and count in the means' token total), ``n_tokens`` the tokens measured
(only that one is logged when it is 0: no measurement is not a perfect one), and the sequence
weights w = exp(Σ_t δ_t) of the measured sequences: ``seq_weight_median``, ``seq_weight_min`` and
``seq_weight_low_fraction`` (the share below 0.1).

Device rules (the 910B's): everything here is fp32 on the device (CANN computes no float64; k3
keeps its precision through ``k3_of_log_ratio``), and no result has a data-dependent shape (a
boolean-mask index is a hidden device -> host sync per micro-batch): the per-sequence weights
travel with a mask of the measured sequences and are selected on the host, in ``to_log``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import get_args

import torch

from megatron_rl.config.schema import (
    AlarmAction,
    CorrectionMode,
    MismatchAlarmConfig,
    RolloutCorrectionConfig,
)
from megatron_rl.config.sections import require_valid

CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
ALARM_ACTIONS: tuple[str, ...] = get_args(AlarmAction)


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection(RolloutCorrectionConfig):
    """Rollout importance-sampling correction (TRL semantics) and off-policy masking: the
    ``algorithm.rollout_correction`` section (mode, c_min, c_max, delta; declared once, in the
    schema), checked by the config's own rules for that section (also when built from Python)."""

    def __post_init__(self) -> None:
        require_valid(self, "algorithm.rollout_correction")


@dataclass(frozen=True, kw_only=True)
class MismatchMetrics:
    """Sums and maxima over counted tokens (0-dim detached tensors); merge adds / maxes."""

    n_tokens: torch.Tensor  # counted tokens measured
    abs_diff_sum: torch.Tensor  # Σ |log π_trainer − log π_behav|
    abs_diff_max: torch.Tensor
    kl_k3_sum: torch.Tensor  # Σ k3 estimate of KL(π_behav ‖ π_trainer)
    seq_ratio_max: torch.Tensor  # max over sequences of exp(Σ_t δ_t)
    n_masked: torch.Tensor  # counted tokens whose weight the correction set to 0
    n_nonfinite: torch.Tensor  # counted tokens whose behaviour log-prob is NaN / ±inf
    seq_log_weights: torch.Tensor  # [S] Σ_t δ_t of each sequence, 0 if unmeasured (merge concatenates)
    seq_measured: torch.Tensor  # [S] bool: the sequence has a measured token (merge concatenates)
    # counted tokens (measured or stale) that δ masking dropped; None when δ is off
    n_delta_dropped: torch.Tensor | None = None

    SUM_FIELDS = ("n_tokens", "abs_diff_sum", "kl_k3_sum", "n_masked", "n_nonfinite")
    MAX_FIELDS = ("abs_diff_max", "seq_ratio_max")
    CAT_FIELDS = ("seq_log_weights", "seq_measured")
    SEQUENCE_LOW = 0.1  # seq_weight_low_fraction: sequences whose weight is below this

    def merge(self, other: MismatchMetrics) -> MismatchMetrics:
        """Statistics of the union of both token sets."""

        def combine(name: str) -> torch.Tensor:
            a, b = getattr(self, name), getattr(other, name)
            if a is None or b is None:  # n_delta_dropped: δ off on one side counts 0 there
                return b if a is None else a
            if name in self.CAT_FIELDS:
                return torch.cat([a, b.to(a.device)])
            return (torch.maximum if name in self.MAX_FIELDS else torch.add)(a, b)

        return replace(self, **{f.name: combine(f.name) for f in fields(self)})

    def to_log(self, prefix: str = "mismatch/") -> dict[str, float]:
        """The ``mismatch/…`` metrics as plain floats (syncs with the device); ``n_tokens`` alone
        when no token was measured."""
        n = float(self.n_tokens)
        delta = {} if self.n_delta_dropped is None else {prefix + "delta_dropped_tokens": float(self.n_delta_dropped)}
        if n <= 0:
            return {prefix + "n_tokens": 0.0, **delta}
        host = self.seq_log_weights.detach().cpu().double()  # fp64 on the host only
        weights = torch.exp(host[self.seq_measured.detach().cpu()])
        out = {
            "n_tokens": n,
            "logprob_abs_diff_mean": float(self.abs_diff_sum) / n,
            "logprob_abs_diff_max": float(self.abs_diff_max),
            "kl_k3": float(self.kl_k3_sum) / n,
            "seq_ratio_max": float(self.seq_ratio_max),
            "masked_fraction": float(self.n_masked) / n,
            "nonfinite_behav": float(self.n_nonfinite),
        }
        if weights.numel():
            out.update(
                seq_weight_median=float(weights.median()),
                seq_weight_min=float(weights.min()),
                seq_weight_low_fraction=float((weights < self.SEQUENCE_LOW).double().mean()),
            )
        return {prefix + k: v for k, v in out.items()} | delta


@dataclass(frozen=True, kw_only=True)
class Correction:
    """``weight [B, L]``: detached factor on the policy term (0 on padding and dropped tokens);
    ``dropped [B, L]`` bool: counted tokens the mask modes or δ removed; ``metrics``."""

    weight: torch.Tensor
    dropped: torch.Tensor
    metrics: MismatchMetrics


def nonfinite_behav(behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, L]`` bool: counted tokens whose behaviour log-prob is NaN or ±inf (padding aside)."""
    return mask.bool() & ~torch.isfinite(behav_logp.detach())


def log_ratio(trainer_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """δ_t = log π_trainer − log π_behav on counted tokens with a finite behaviour log-prob, 0
    elsewhere and where NaN: ``[B, L]``. A non-finite behaviour log-prob is no match: callers count
    it (``nonfinite_behav``) and drop it; here it only must not reach an exp."""
    counted = mask.bool() & torch.isfinite(behav_logp.detach())
    diff = torch.where(counted, trainer_logp.detach() - behav_logp.detach(), 0.0)
    return torch.nan_to_num(diff, nan=0.0)


def importance_ratio(delta_t: torch.Tensor, mode: CorrectionMode, mask: torch.Tensor) -> torch.Tensor:
    """The raw ratio from ``log_ratio``: ``[B, L]`` for token modes (TRL), ``[B, 1]`` for sequence
    modes (TRL: exp of the sum) and geometric modes (exp of the mean over ``mask``'s tokens)."""
    if mode.startswith("sequence_"):
        return torch.exp(delta_t.sum(dim=-1, keepdim=True))
    if mode.startswith("geometric_"):
        tokens = mask.bool().sum(dim=-1, keepdim=True).clamp(min=1).to(delta_t.dtype)
        return torch.exp(delta_t.sum(dim=-1, keepdim=True) / tokens)
    return torch.exp(delta_t)


def bound_ratio(
    ratio: torch.Tensor, mode: CorrectionMode, c_min: float | None, c_max: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounded ratio, dropped) of the same shape: truncate clamps, mask zeroes outside [C_min, C_max]."""
    if mode == "none":
        return torch.ones_like(ratio), torch.zeros_like(ratio, dtype=torch.bool)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=c_min, max=c_max), torch.zeros_like(ratio, dtype=torch.bool)
    low = -math.inf if c_min is None else c_min
    high = math.inf if c_max is None else c_max
    outside = (ratio < low) | (ratio > high)
    return ratio.masked_fill(outside, 0.0), outside


def off_policy_keep(
    advantages: torch.Tensor, logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, delta: float
) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence mask, ``[B]`` bool (True = keep); formula in the module doc.

    ``logp [B, L]``: the policy being trained (detached here), ``behav_logp [B, L]``, ``mask [B, L]``,
    ``advantages [B]``.
    """
    counted = mask.bool()
    finite = torch.isfinite(behav_logp.detach())  # a non-finite one is dropped by the caller; 0 here
    kl = torch.nan_to_num(torch.where(finite, behav_logp.detach() - logp.detach(), 0.0), nan=0.0)
    seq_kl = torch.where(counted, kl, 0.0).sum(dim=-1) / counted.sum(dim=-1).clamp(min=1).to(kl.dtype)
    return (advantages >= 0) | (seq_kl <= delta)


def rollout_correction(
    settings: RolloutCorrection,
    *,
    trainer_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    measured: torch.Tensor | None = None,
) -> Correction:
    """The per-token correction weight, what it dropped, and the mismatch metrics.

    ``trainer_logp [B, L]`` old-policy (or detached policy) log-probs, ``behav_logp [B, L]``
    engine log-probs, ``logp [B, L]`` the policy being trained (δ-masking only; detached),
    ``advantages [B]``, ``mask [B, L]``. ``measured [B, L]`` (default: ``mask``): the counted
    tokens that ``trainer_logp`` compares with the weights that sampled them (staleness 0); the
    mode's ratio and the metrics use those alone (weight 1 on the others), while δ masking (it
    needs only π_θ and π_behav) and the non-finite drop act on every counted token. Everything
    returned is detached.
    """
    with torch.no_grad():
        counted = mask.bool()
        measured = counted if measured is None else measured.bool() & counted
        delta_t = log_ratio(trainer_logp, behav_logp, measured)
        weight, dropped = bound_ratio(
            importance_ratio(delta_t, settings.mode, measured), settings.mode, settings.c_min, settings.c_max
        )
        weight = torch.where(measured, weight.expand_as(delta_t), 1.0)
        dropped = dropped.expand_as(delta_t) & measured
        delta_dropped = None
        if settings.delta is not None:
            keep = off_policy_keep(advantages, logp, behav_logp, mask, settings.delta)[:, None]
            weight, dropped = weight * keep.to(weight.dtype), dropped | ~keep
            delta_dropped = (~keep & counted).sum().float()
        dropped = (dropped | nonfinite_behav(behav_logp, mask)) & counted  # no measurement: out, in every mode
        weight = torch.where(counted & ~dropped, weight, 0.0)
        metrics = replace(mismatch_metrics(trainer_logp, behav_logp, measured, dropped), n_delta_dropped=delta_dropped)
    return Correction(weight=weight, dropped=dropped, metrics=metrics)


# |δ| below this: k3 from its Taylor series (Horner, a few fp32 ulps); the truncation after δ¹²
# leaves a relative error ≤ 2·|δ|¹¹/13! < 4e-10 there, and above it expm1(δ) − δ cancels at
# most ~2 bits (k3 ≥ 0.36·|expm1(δ)|): both well inside 1e-6 of the exact value.
_K3_SERIES_BELOW = 1.0
_K3_SERIES = tuple(1.0 / math.factorial(n) for n in range(2, 13))  # 1/2!, 1/3!, …, 1/12!


def k3_of_log_ratio(delta: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 = exp(δ) − 1 − δ of a log-ratio δ, elementwise in ``delta``'s dtype, accurate
    to a few ulps in fp32: the direct form cancels (k3 ≈ δ²/2 vanishes against δ for tiny δ), so
    small |δ| use the series δ² (1/2! + δ/3! + … + δ¹⁰/12!)."""
    series = torch.full_like(delta, _K3_SERIES[-1])
    for coefficient in reversed(_K3_SERIES[:-1]):
        series = series * delta + coefficient
    return torch.where(delta.abs() < _K3_SERIES_BELOW, series * delta.square(), torch.expm1(delta) - delta)


@torch.no_grad()
def mismatch_metrics(
    trainer_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, dropped: torch.Tensor | None = None
) -> MismatchMetrics:
    """Mismatch statistics over the counted tokens of ``mask [B, L]`` (``dropped [B, L]`` bool)."""
    counted = mask.bool()
    delta_t = log_ratio(trainer_logp, behav_logp, mask)
    zero = torch.zeros((), dtype=torch.float32, device=delta_t.device)
    delta_t = delta_t.float()
    k3 = k3_of_log_ratio(delta_t)  # Schulman's k3 of KL(π_behav ‖ π_trainer), r = π_trainer / π_behav
    seq_sum = delta_t.sum(dim=-1)
    seq_ratio = torch.exp(seq_sum)
    has_tokens = counted.any(dim=-1)
    return MismatchMetrics(
        n_tokens=counted.sum().float(),
        abs_diff_sum=delta_t.abs().sum(),
        abs_diff_max=delta_t.abs().max().float() if delta_t.numel() else zero,
        kl_k3_sum=torch.where(counted, k3, 0.0).sum().float(),
        seq_ratio_max=torch.where(has_tokens, seq_ratio, 0.0).max().float() if has_tokens.numel() else zero,
        n_masked=zero if dropped is None else (dropped & counted).sum().float(),
        n_nonfinite=nonfinite_behav(behav_logp, mask).sum().float(),
        seq_log_weights=torch.where(has_tokens, seq_sum, 0.0),  # no mask index: a host sync
        seq_measured=has_tokens,
    )


@dataclass(frozen=True, kw_only=True)
class MismatchAlarm(MismatchAlarmConfig):
    """Thresholds on the ``mismatch/…`` metrics of an optimizer step (None = not checked) and the
    action: the ``algorithm.mismatch_alarm`` section (declared once, in the schema), checked."""

    def __post_init__(self) -> None:
        require_valid(self, "algorithm.mismatch_alarm")  # the config's own rules for the section

    def thresholds(self) -> dict[str, float | None]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "action"}


LIKELY_CAUSES = (
    "engine dtype lower than the trainer's (bf16 engine vs fp32 trainer: rollout.vllm dtype / "
    "model.dtype); top_p < 1 (behaviour log-probs are after top-p, the trainer's are not); "
    "a different attention / matmul kernel in the engine; engine weights not synced to the "
    "trainer's version (weight sync failed or skipped); temperature differs between "
    "rollout.sampling.temperature and algorithm.temperature"
)


class MismatchAlarmError(RuntimeError):
    """The training–inference mismatch exceeded ``algorithm.mismatch_alarm`` with action ``stop``."""


NONFINITE_CAUSES = (
    "the engine returned NaN / inf log-probs (an overflow in its dtype, a broken kernel or "
    "weights); those tokens were kept out of the loss"
)


def alarm_verdict(alarm: MismatchAlarm | None, metrics: MismatchMetrics | None) -> str | None:
    """A message naming every metric above its threshold, or None when all are within (pure).
    Any non-finite behaviour log-prob is over the limit of every alarm, whatever its thresholds."""
    if alarm is None or metrics is None or float(metrics.n_tokens) <= 0:
        return None
    values = metrics.to_log(prefix="")
    over = [
        f"mismatch/{name} = {values[name]:.6g} > {limit:.6g}"
        for name, limit in alarm.thresholds().items()
        if limit is not None and not values[name] <= limit
    ]  # NaN counts as over
    nonfinite = values["nonfinite_behav"] > 0
    if nonfinite:
        over.append(f"mismatch/nonfinite_behav = {values['nonfinite_behav']:.0f} > 0")
    if not over:
        return None
    causes = (NONFINITE_CAUSES + "; " if nonfinite else "") + LIKELY_CAUSES
    return (
        "training–inference mismatch above algorithm.mismatch_alarm: "
        + "; ".join(over)
        + ". Likely causes: "
        + causes
        + "."
    )
