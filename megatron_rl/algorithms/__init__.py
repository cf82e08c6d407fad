"""RL objectives as pure tensor functions: advantages, policy losses, A-3PO proximal, KL
estimators, rollout (training–inference mismatch) correction and its alarm.

No process groups and no I/O here: the trainer all-reduces what ``loss_denominator`` and
``LossMetrics`` document, everything else is tensor in, tensor out.
"""

from megatron_rl.algorithms.advantages import (
    ADVANTAGE_SCALES,
    AdvantageScale,
    group_advantages,
)
from megatron_rl.algorithms.correction import (
    CORRECTION_MODES,
    CorrectionMode,
    MismatchAlarm,
    MismatchAlarmError,
    MismatchMetrics,
    RolloutCorrection,
    alarm_verdict,
    rollout_correction,
)
from megatron_rl.algorithms.dapo import dynamic_sampling_keep, overlong_reward_delta
from megatron_rl.algorithms.kl import KL_ESTIMATORS, KLEstimator, kl_estimate
from megatron_rl.algorithms.loss_table import LOSSES, LossEntry, loss_entry
from megatron_rl.algorithms.losses import (
    LOSS_KINDS,
    PROXIMAL_MODES,
    LossKind,
    LossOutput,
    LossSettings,
    ProximalMode,
    loss_denominator,
    policy_loss,
)
from megatron_rl.algorithms.metrics import MAX_FIELDS, SUM_FIELDS, LossMetrics
from megatron_rl.algorithms.proximal import (
    BehaviourWeight,
    behaviour_weight,
    loglinear_proximal_logp,
    staleness_alpha,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "CORRECTION_MODES",
    "KL_ESTIMATORS",
    "LOSSES",
    "LOSS_KINDS",
    "MAX_FIELDS",
    "PROXIMAL_MODES",
    "SUM_FIELDS",
    "AdvantageScale",
    "BehaviourWeight",
    "CorrectionMode",
    "KLEstimator",
    "LossEntry",
    "LossKind",
    "LossMetrics",
    "LossOutput",
    "LossSettings",
    "MismatchAlarm",
    "MismatchAlarmError",
    "MismatchMetrics",
    "ProximalMode",
    "RolloutCorrection",
    "alarm_verdict",
    "behaviour_weight",
    "dynamic_sampling_keep",
    "group_advantages",
    "kl_estimate",
    "loglinear_proximal_logp",
    "loss_denominator",
    "loss_entry",
    "overlong_reward_delta",
    "policy_loss",
    "rollout_correction",
    "staleness_alpha",
]
