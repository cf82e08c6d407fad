"""``--scope train``: the trainer alone (policy + tri-model + optimizer, no engine) on synthetic
groups with set prompt / response length distributions.

The groups go through the real data path: ``Sample`` records scored by the config's
``GroupScoring`` into ``ScoredGroup``s, queued as ``BatchStart`` / groups / ``BatchEnd`` and cut by
the pipeline's ``StepBatch`` into mini- and micro-batches (shared-prompt packing, token budget,
group splitting, routing to data-parallel replicas), then trained by the run training builds
(``trainer.setup.build_replica``) through the loop's own ``run_step``: micro-steps, one optimizer
step per mini-batch, weight sync (the configured sender, with no engine to receive it). At DP > 1
rank 0 dispatches each micro-batch to the replica it is routed to, as in training. Token counts
are read back from the packed micro-batches that were trained.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.bench.flops import GroupShape, training_flops
from megatron_rl.bench.lengths import LengthDist
from megatron_rl.bench.options import BenchOptions, peak_memory, resolve_peak
from megatron_rl.bench.result import BenchResult, StepMeasure, aggregate
from megatron_rl.config import Config, config_to_dict
from megatron_rl.pipeline import BatchEnd, BatchStart, MicroBatch, Sample, StepBatch, score_group
from megatron_rl.pipeline.batching import is_padding
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticGroups:
    """Deterministic synthetic groups: step ``s`` always yields the same tokens and lengths."""

    vocab_size: int
    num_prompts: int
    group_size: int
    prompt_len: LengthDist
    response_len: LengthDist
    max_prompt_tokens: int
    max_new_tokens: int
    seed: int = 0

    def samples(self, step: int) -> list[list[Sample]]:
        """``num_prompts`` lists of ``group_size`` samples (random tokens, uniform-policy log-probs)."""
        rng = np.random.default_rng([self.seed, step])
        prompt_lens = self.prompt_len.sample(rng, self.num_prompts, cap=self.max_prompt_tokens)
        behav = -math.log(self.vocab_size)  # log-prob of any token under a uniform policy
        out = []
        for p, lp in enumerate(prompt_lens):
            prompt = tuple(int(t) for t in rng.integers(0, self.vocab_size, lp))
            lens = self.response_len.sample(rng, self.group_size, cap=self.max_new_tokens)
            responses = [tuple(int(t) for t in rng.integers(0, self.vocab_size, n)) for n in lens]
            out.append(
                [
                    Sample(
                        prompt_id=f"synthetic-{p}",
                        request_id=f"{step}/synthetic-{p}/{k}",
                        index=k,
                        prompt_ids=prompt,
                        response_ids=responses[k],
                        behav_logprobs=(behav,) * n,
                        weight_version=step,
                        finish_reason="length" if n == self.max_new_tokens else "stop",
                        reward=float(rng.random()),
                    )
                    for k, n in enumerate(lens)
                ]
            )
        return out

    @classmethod
    def from_config(cls, cfg: Config, opts: BenchOptions, vocab_size: int) -> SyntheticGroups:
        return cls(
            vocab_size=vocab_size,
            num_prompts=cfg.trainer.prompts_per_batch,
            group_size=cfg.control.group_size,
            prompt_len=opts.prompt_len,
            response_len=opts.response_len,
            max_prompt_tokens=cfg.data.max_prompt_tokens,
            max_new_tokens=cfg.rollout.sampling.max_new_tokens,
            seed=opts.seed,
        )


class SyntheticSteps:
    """The pipeline of the train scope: ``begin_step`` cuts step ``s``'s synthetic groups, scored
    by the config's ``GroupScoring``, into the training ``StepBatch`` (the whole batch queued:
    the sync cut), routed over ``replicas`` data-parallel replicas as training routes them."""

    def __init__(self, cfg: Config, groups: SyntheticGroups, *, replicas: int = 1) -> None:
        self.cfg, self.groups, self.replicas, self.step = cfg, groups, replicas, 0
        self.items: list = []

    def prepare(self) -> None:
        """Make and score the next step's groups (outside the measured step, as the producer would)."""
        self.items = queue_items(self.cfg, self.groups, self.step)

    def begin_step(self) -> StepBatch:
        """The next step's batch (``prepare`` first)."""
        queue = collections.deque(self.items)
        cutting = dataclasses.replace(  # the whole batch first; EP lockstep as training
            from_config.pipeline_settings(self.cfg).cutting(self.replicas), streamed=False, flush_when_idle=False
        )
        return StepBatch(queue.popleft(), self.step, cutting, pop=queue.popleft, queue_empty=lambda: not queue)

    def complete(self, batch: StepBatch, version: int) -> int:
        """The step is done (nothing to publish: no engine)."""
        self.step += 1
        return version


class ShapeRecorder:
    """``LeaderReplica`` calls passed through; records the groups of every micro-batch trained,
    on whichever replica it was routed to (at DP > 1 the loop's dispatcher thread sends the other
    replicas' micro-batches through ``train_micro_batch`` too, as in training)."""

    def __init__(self, leader) -> None:
        self.leader, self.shapes = leader, []
        self.dispatch = leader.dispatch  # what trainer.dispatcher.dispatch_ahead looks for

    def train_micro_batch(self, mb: MicroBatch) -> None:
        if not is_padding(mb):  # expert parallelism's padding: collectives only, no trained token
            self.shapes += trained_shapes(mb)
        self.leader.train_micro_batch(mb)

    def optimizer_step(self) -> None:
        self.leader.optimizer_step()

    def sync_weights(self, version: int) -> int:
        return self.leader.sync_weights(version)

    def pop_shapes(self) -> tuple[GroupShape, ...]:
        out, self.shapes = tuple(self.shapes), []
        return out


def queue_items(cfg: Config, groups: SyntheticGroups, step: int) -> list:
    """The queue of one step as the producer would fill it: start marker, scored groups, end marker."""
    scoring = from_config.group_scoring(cfg)
    scored = [
        score_group(step=step, prompt_index=p, samples=s, scoring=scoring) for p, s in enumerate(groups.samples(step))
    ]
    lengths = tuple(len(s.response_ids) for g in scored for s in g.samples)
    return [
        BatchStart(step=step, num_prompts=len(scored), group_size=groups.group_size),
        *scored,
        BatchEnd(
            step=step,
            group_size=groups.group_size,
            response_lengths=lengths,
            groups_produced=len(scored),
            groups_dropped=sum(not g.kept for g in scored),
            source_state=None,
        ),
    ]


def trained_shapes(mb: MicroBatch) -> list[GroupShape]:
    """The groups (or group parts) of a packed micro-batch, read from its packed tensors."""
    packed, out = mb.packed, []
    for g in torch.unique(packed.group_ids).tolist():
        seg = packed.segment_ids[packed.group_ids == g]
        counts = torch.bincount(seg)
        out.append(GroupShape(prompt_len=int(counts[0]), response_lens=tuple(int(c) for c in counts[1:] if c > 0)))
    return out


def run_train_scope(cfg: Config, opts: BenchOptions) -> BenchResult | None:
    """Build the run as training does (``trainer.setup``), train ``warmup + steps`` synthetic steps
    with the loop's ``run_step``; the result on global rank 0 (else None)."""
    from megatron_rl.trainer.replica import LeaderReplica, follow
    from megatron_rl.trainer.setup import build_replica, start_world

    plat, layout = start_world(cfg, opts.platform)
    replica = build_replica(_quiet(cfg), layout)
    if dist.get_rank() != 0:  # the followers of rank 0, at DP > 1 through the training dispatch
        follow(replica)
        _remove(replica.snapshot_root)
        return None
    leader = ShapeRecorder(LeaderReplica(replica))
    steps = SyntheticSteps(cfg, SyntheticGroups.from_config(cfg, opts, replica.spec.vocab_size), replicas=layout.dp)
    frozen = len(replica.trainer.trimodel.plan.active) - 1
    try:
        measured = [_measured_step(steps, leader, replica, frozen) for _ in range(opts.warmup + opts.steps)]
    finally:
        leader.leader.stop_followers()
        _remove(replica.snapshot_root)
    world = {
        "platform": plat.name,
        "world_size": layout.world_size,
        "tp": layout.tp,
        "pp": layout.pp,
        "dp": layout.dp,
        "engines": 0,
    }
    peak = resolve_peak(opts, plat.device_type, DTYPES[cfg.model.dtype])
    return aggregate(
        measured[opts.warmup :],
        scope="train",
        warmup=opts.warmup,
        devices=layout.world_size,
        train_devices=layout.world_size,
        peak=peak,
        memory=peak_memory(plat.device_type),
        world=world,
        config=config_to_dict(cfg),
        extra={"frozen_forwards": float(frozen)},
    )


def _measured_step(steps: SyntheticSteps, leader: ShapeRecorder, replica, frozen: int) -> StepMeasure:
    """One synthetic step through the loop's ``run_step``: its seconds, phases, group shapes, FLOPs."""
    from megatron_rl.trainer.loop import run_step

    steps.prepare()
    _, step_s = run_step(steps, leader)
    shapes, (_, seconds) = leader.pop_shapes(), replica.pop_results()
    flops = training_flops(replica.spec, shapes, frozen_forwards=frozen)
    return StepMeasure(step_s=step_s, phases=seconds, groups=shapes, flops=flops)


def _quiet(cfg: Config) -> Config:
    """``cfg`` without the mismatch alarm's KL gate: the synthetic behaviour log-probs are not a
    real engine's, the gate would only cry wolf."""
    a = cfg.algorithm
    alarm = dataclasses.replace(a.mismatch_alarm, kl_k3=None)
    return dataclasses.replace(cfg, algorithm=dataclasses.replace(a, mismatch_alarm=alarm))


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
