"""The engine probe: the training–inference mismatch measured right after every weight sync.

In ``stale`` mode every sample is d >= 1 versions old in steady state, so the loss has no token
whose engine and trainer log-probs come from the same weights and measures nothing
(``mismatch/n_tokens`` 0). The probe measures the engine directly: right after the engines load
version v, the leader has them score (prefill only, ``RolloutEngine.score``) a few sequences the
trainer just trained on, and every rank of replica 0 runs the policy (now at version v: it is
what was just synced) forward on the same sequences, no grad, through the tri-model's policy
stage on the compute device. With expert parallelism (``parallel.ep`` > 1) every replica runs
that forward, since the MoE layers' EP collectives span the replicas; replica 0's alone counts.
Both sides use temperature 1 (vLLM's prompt log-probs ignore temperature:
``rollout.scoring``), so the probe sees weights and kernels, not a temperature gap.

The comparison is the loss's (``correction.mismatch_metrics``, δ = log π_trainer − log π_engine),
merged over the world (``world_metrics``) and logged under ``mismatch_probe/`` (with
``mismatch_probe/n_tokens``); the mismatch alarm reads it on every rank, so an engine that
acknowledges a version without loading it is caught at that sync, whatever the mode.

``algorithm.rollout_correction.probe_sequences``: sequences per probe; None = 4 in stale mode
(where nothing else measures the engine) and 0 (off) otherwise, where the loss measures every
token; off in a replay (no engine). Cost per step: one prefill of those sequences on the engine
and one forward on the trainer (``time/probe_s``).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch

from megatron_rl.algorithms.correction import mismatch_metrics
from megatron_rl.attention.packing import PackedMicroBatch, pad_responses, unpack_logprobs_padded
from megatron_rl.pipeline.batching import is_padding
from megatron_rl.pipeline.records import MicroBatch, make_micro_batch
from megatron_rl.rollout.scoring import ScoreRequest
from megatron_rl.trainer.mismatch_gate import check_mismatch
from megatron_rl.trainer.world_metrics import counts_loss, world_merged

STALE_DEFAULT = 4  # probe_sequences when unset in stale mode
PREFIX = "mismatch_probe/"


def make_probe(cfg, engine, *, replay: bool) -> EngineProbe | None:
    """The leader's probe of ``engine`` for ``cfg`` (``probe_sequences``, None = the mode's default;
    off in a replay), or None when off. An engine without ``score`` (a custom ``engine_factory``)
    is refused when the probe was asked for, and skipped with a warning when it was the default."""
    configured = cfg.algorithm.rollout_correction.probe_sequences
    n = STALE_DEFAULT if configured is None and cfg.pipeline.mode == "stale" else configured or 0
    if replay or n == 0:
        return None
    if not callable(getattr(engine, "score", None)):
        if configured is not None:
            raise ValueError(
                f"algorithm.rollout_correction.probe_sequences={configured}: the rollout engine "
                f"({type(engine).__name__}) has no score(); set it to 0"
            )
        warnings.warn(
            f"engine probe off: the rollout engine ({type(engine).__name__}) has no score(), so "
            "stale mode measures no mismatch",
            stacklevel=2,
        )
        return None
    return EngineProbe(engine, n)


@dataclass(frozen=True, kw_only=True)
class ProbeInput:
    """What the leader sends every rank after scoring: the sequences and the engine's log-probs."""

    version: int  # the version the engines just loaded (and the policy holds)
    micro_batch: MicroBatch  # the probed sequences, packed
    engine_logprobs: torch.Tensor  # [N] fp32 host, packed response order
    engine_s: float  # seconds the engines took to score


class EngineProbe:
    """The leader's side: remembers the last trained micro-batch, has the engines score its first
    ``sequences`` sequences after a sync."""

    def __init__(self, engine, sequences: int) -> None:
        if sequences < 1:
            raise ValueError(f"EngineProbe needs sequences >= 1, got {sequences}")
        self.engine, self.sequences = engine, sequences
        self.last: MicroBatch | None = None

    def remember(self, mb: MicroBatch) -> None:
        """Keep ``mb`` (its ``groups`` must be there: the leader's copy) as the next probe's source;
        a padding micro-batch (expert parallelism: nothing to measure) is passed over."""
        if mb.groups and not is_padding(mb):
            self.last = mb

    def request(self, version: int) -> ProbeInput | None:
        """Score the probe sequences on the engines, now at ``version``; None before any training."""
        if self.last is None:
            return None
        mb = probe_batch(self.last, self.sequences, version)
        samples = [s for g in mb.groups for s in g.samples]
        start = time.perf_counter()
        scores = self.engine.score(
            [
                ScoreRequest(request_id=f"probe/{version}/{i}", prompt_ids=s.prompt_ids, response_ids=s.response_ids)
                for i, s in enumerate(samples)
            ]
        )
        seconds = time.perf_counter() - start
        wrong = {r.weight_version for r in scores} - {version}
        if wrong:
            raise RuntimeError(
                f"engine probe: the engines scored at version(s) {sorted(wrong)} right after loading version {version}"
            )
        logprobs = torch.tensor([lp for r in scores for lp in r.logprobs], dtype=torch.float32)
        return ProbeInput(version=version, micro_batch=mb, engine_logprobs=logprobs, engine_s=seconds)


def probe_batch(mb: MicroBatch, sequences: int, version: int) -> MicroBatch:
    """The first ``sequences`` sequences of ``mb`` (group by group, sample order), packed anew."""
    parts, left = [], sequences
    for g in mb.groups:
        if left <= 0:
            break
        k = min(left, len(g.samples))
        parts.append(dataclasses.replace(g, samples=g.samples[:k], rewards=g.rewards[:k], advantages=g.advantages[:k]))
        left -= k
    return make_micro_batch(parts, policy_version=version)


def measure_probe(trainer, probe: ProbeInput) -> dict[str, float]:
    """Every rank: the policy's log-probs of the probe on replica 0 (forwarded by every replica at
    EP > 1, for the MoE collectives), compared with the engine's, merged over the world, checked
    by the mismatch alarm; the ``mismatch_probe/`` metrics."""
    from megatron.core import parallel_state as ps

    in_replica = ps.get_data_parallel_rank() == 0  # one replica measures: all hold the same weights
    # With expert parallelism the MoE layers' EP collectives span the replicas: all of them run the
    # forward (the same sequences), replica 0's result alone is counted.
    forwards = in_replica or ps.get_expert_model_parallel_world_size() > 1
    local = None
    if forwards:
        mb = probe.micro_batch.to(trainer.device)
        lp = policy_logprobs(trainer.trimodel, mb.packed)
        if lp is not None and in_replica:  # the last stage
            local = compare_probe(lp, probe.engine_logprobs.to(trainer.device), mb)
    world = world_merged(local, counts=in_replica and counts_loss())
    check_mismatch(
        trainer.loss.mismatch_alarm, world, when=f"engine probe right after the sync of version {probe.version}"
    )
    out = {} if world is None else world.to_log(prefix=PREFIX)
    return out | {
        "probe/engine_s": probe.engine_s,
        "probe/sequences": float(len(probe.micro_batch.packed.response_lens)),
        "probe/tokens": float(probe.micro_batch.packed.num_tokens),
    }


def compare_probe(policy: torch.Tensor, engine: torch.Tensor, mb: MicroBatch):
    """Mismatch metrics of the policy's ``[N]`` log-probs against the engine's on ``mb``'s model
    tokens (observation tokens of multi-turn trajectories are not the engine's samples and are
    left out, as the loss leaves them out)."""
    logp, mask = unpack_logprobs_padded(policy, mb.packed)
    if mb.loss_mask is not None:
        mask = mask & pad_responses(mb.loss_mask, mb.packed, pad_value=False)
    return mismatch_metrics(logp, pad_responses(engine, mb.packed), mask)


@torch.no_grad()
def policy_logprobs(trimodel, packed: PackedMicroBatch) -> torch.Tensor | None:
    """``[N]`` fp32 policy log-probs of ``packed``'s response tokens at temperature 1 on the last
    stage (None elsewhere): one forward-only schedule of the policy stream alone (no old / ref),
    every rank of the model-parallel group taking part."""
    from megatron_rl.parallel.schedule import run_schedule
    from megatron_rl.trimodel.stage import LogprobSettings, TriStage

    stage = TriStage(
        policy=trimodel.policy,
        old=None,
        ref=None,
        logprobs=LogprobSettings(
            vocab_size=trimodel.stage.logprobs.vocab_size,
            temperature=1.0,
            logprob_chunk_tokens=trimodel.stage.logprobs.logprob_chunk_tokens,
        ),
    )
    out = run_schedule(
        stage,
        [packed],
        forward_step=lambda s, mb: s(mb),
        loss=lambda lp, _mb: (lp.policy.sum() * 0, lp.policy.float()),
        seq_length=lambda mb: mb.num_tokens,
        forward_only=True,
    )
    return out[0] if out else None
