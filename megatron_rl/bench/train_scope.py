"""``--scope train``: the trainer alone (policy + tri-model + optimizer, no engine) on synthetic
groups with set prompt / response length distributions.

The groups go through the real data path: ``Sample`` records scored by the config's
``GroupScoring`` into ``ScoredGroup``s, queued as ``BatchStart`` / groups / ``BatchEnd`` and cut by
the pipeline's ``StepBatch`` into mini- and micro-batches (shared-prompt packing, token budget,
group splitting), then trained by the replica exactly as the loop does: micro-steps, one optimizer
step per mini-batch, weight sync (the snapshot or broadcast export, with no engine to receive it).
Token counts are read back from the packed micro-batches that were trained.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.algorithms import MismatchAlarm
from megatron_rl.bench.flops import GroupShape, training_flops
from megatron_rl.bench.lengths import LengthDist
from megatron_rl.bench.options import BenchOptions, peak_memory, resolve_peak
from megatron_rl.bench.result import BenchResult, StepMeasure, aggregate
from megatron_rl.config import Config, config_to_dict, validate_world
from megatron_rl.pipeline import BatchEnd, BatchStart, MicroBatch, Sample, StepBatch, score_group
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import DTYPES, build_policy_trainer


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
            out.append([Sample(prompt_id=f"synthetic-{p}", request_id=f"{step}/synthetic-{p}/{k}", index=k,
                               prompt_ids=prompt, response_ids=responses[k],
                               behav_logprobs=(behav,) * n, weight_version=step,
                               finish_reason="length" if n == self.max_new_tokens else "stop",
                               reward=float(rng.random()))
                        for k, n in enumerate(lens)])
        return out

    @classmethod
    def from_config(cls, cfg: Config, opts: BenchOptions, vocab_size: int) -> SyntheticGroups:
        return cls(vocab_size=vocab_size, num_prompts=cfg.trainer.prompts_per_batch, group_size=cfg.control.group_size,
                   prompt_len=opts.prompt_len, response_len=opts.response_len,
                   max_prompt_tokens=cfg.data.max_prompt_tokens, max_new_tokens=cfg.rollout.sampling.max_new_tokens,
                   seed=opts.seed)


def queue_items(cfg: Config, groups: SyntheticGroups, step: int) -> list:
    """The queue of one step as the producer would fill it: start marker, scored groups, end marker."""
    scoring = from_config.group_scoring(cfg)
    scored = [score_group(step=step, prompt_index=p, samples=s, scoring=scoring)
              for p, s in enumerate(groups.samples(step))]
    lengths = tuple(len(s.response_ids) for g in scored for s in g.samples)
    return [BatchStart(step=step, num_prompts=len(scored), group_size=groups.group_size), *scored,
            BatchEnd(step=step, group_size=groups.group_size, response_lengths=lengths, groups_produced=len(scored),
                     groups_dropped=sum(not g.kept for g in scored), source_state=None)]


def trained_shapes(mb: MicroBatch) -> list[GroupShape]:
    """The groups (or group parts) of a packed micro-batch, read from its packed tensors."""
    packed, out = mb.packed, []
    for g in torch.unique(packed.group_ids).tolist():
        seg = packed.segment_ids[packed.group_ids == g]
        counts = torch.bincount(seg)
        out.append(GroupShape(prompt_len=int(counts[0]), response_lens=tuple(int(c) for c in counts[1:] if c > 0)))
    return out


def run_train_scope(cfg: Config, opts: BenchOptions) -> BenchResult | None:
    """Build the trainer, train ``warmup + steps`` synthetic steps; the result on global rank 0 (else None)."""
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.rl_step import LeaderReplica, Replica, ReplicaChannel, follow

    plat, layout = initialize_parallel(tp=cfg.parallel.tp, pp=cfg.parallel.pp, seed=cfg.trainer.seed,
                                       platform=opts.platform)
    validate_world(cfg, layout.world_size)
    settings = from_config.trainer_settings(cfg)
    # The synthetic behaviour log-probs are not a real engine's: the mismatch gate would only cry wolf.
    quiet = dataclasses.replace(settings.loss, mismatch_alarm=MismatchAlarm(kl_k3=None))
    trainer, policy, spec = build_policy_trainer(dataclasses.replace(settings, loss=quiet))
    snapshots = _snapshot_root()
    replica = Replica(trainer, policy, spec, engine=None, snapshot_root=snapshots, source_dir=cfg.model.hf_path,
                      channel=ReplicaChannel(), weight_sync=cfg.rollout.weight_sync)
    if not replica.channel.is_leader:
        follow(replica)
        return None
    # Every DP replica trains the same synthetic batch; global rank 0 reports for its replica.
    leader, groups = LeaderReplica(replica), SyntheticGroups.from_config(cfg, opts, spec.vocab_size)
    frozen = len(trainer.trimodel.plan.active) - 1
    measured = []
    try:
        for step in range(opts.warmup + opts.steps):
            m = _train_step(cfg, leader, queue_items(cfg, groups, step), step)
            measured.append(dataclasses.replace(m, flops=training_flops(spec, m.groups, frozen_forwards=frozen)))
    finally:
        leader.stop_followers()
        _remove(snapshots)
    world = {"platform": plat.device_type, "world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp,
             "dp": layout.dp, "engines": 0}
    if dist.get_rank() != 0:
        return None
    peak = resolve_peak(opts, plat.device_type, DTYPES[cfg.model.dtype])
    replica_devices = layout.tp * layout.pp
    return aggregate(measured[opts.warmup:], scope="train", warmup=opts.warmup, devices=replica_devices,
                     train_devices=replica_devices, peak=peak,
                     memory=peak_memory(plat.device_type), world=world, config=config_to_dict(cfg),
                     extra={"frozen_forwards": float(frozen)})


def _train_step(cfg: Config, leader, items: list, step: int) -> StepMeasure:
    """One step through ``StepBatch`` (sync cut: the whole batch is queued already)."""
    queue = collections.deque(items)
    start = time.perf_counter()
    batch = StepBatch(start=queue.popleft(), policy_version=step, num_mini_batches=cfg.trainer.mini_batches,
                      token_budget=cfg.pipeline.micro_batch_tokens, streamed=False, flush_when_idle=False,
                      pop=queue.popleft, queue_empty=lambda: not queue)
    shapes: list[GroupShape] = []
    for mini_batch in batch.mini_batches():
        for micro_batch in mini_batch:
            shapes += trained_shapes(micro_batch)
            leader.train_micro_batch(micro_batch)
        leader.optimizer_step()
    leader.sync_weights(step + 1)
    step_s = time.perf_counter() - start
    _, seconds = leader.pop_results()
    return StepMeasure(step_s=step_s, phases=seconds, groups=tuple(shapes))


def _snapshot_root() -> Path:
    """A weight-snapshot directory (shared memory when present), the same path on every rank."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    box = [tempfile.mkdtemp(prefix="megatron_rl-bench-", dir=base) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _remove(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
