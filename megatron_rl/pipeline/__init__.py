"""Periodic asynchrony: producer thread -> bounded queue -> consumer; sync / periodic / stale modes.

A producer thread feeds scored groups through a bounded queue to the consumer, which trains them
as they arrive and syncs weights once per batch.

Modules: `records` (Sample, ScoredGroup, BatchStart / BatchEnd, MicroBatch; the one conversion
of a generated trajectory to a Sample, and of samples to tensors), `versions` (which policy
version may generate which batch; staleness), `producer` (the thread: prompts -> generator
(``megatron_rl.generation``) -> rewards -> advantages -> queue; it owns the group-size
controller; ``RolloutInputs`` and ``StepSpan``, what a pipeline is built from), `scoring` (a
finished group's shaped rewards, advantages and dynamic-sampling verdict), `batching` (a step's
groups -> mini-batches in prompt order -> micro-batches under the token budget), `consumer`
(`Pipeline`: begin_step -> micro-batches for the trainer -> complete(new version) -> publish;
shutdown), `recording` (the queue as JSONL, and its replay).
"""

from megatron_rl.generation.base import request_id, request_seed
from megatron_rl.pipeline.batching import BatchCutting, StepBatch
from megatron_rl.pipeline.consumer import BatchSummary, Pipeline, PipelineSettings, summarize
from megatron_rl.pipeline.inputs import PromptSource, RewardCallable, RolloutInputs, StepSpan
from megatron_rl.pipeline.records import (
    BatchEnd,
    BatchStart,
    MicroBatch,
    PipelineError,
    Sample,
    ScoredGroup,
    make_micro_batch,
    sample_from,
    split_group,
    to_token_group,
)
from megatron_rl.pipeline.scoring import GroupScoring, OverlongShaping, failed_group, score_group
from megatron_rl.pipeline.versions import (
    PIPELINE_MODES,
    PipelineMode,
    PolicyVersions,
    StalenessStats,
    VersionSchedule,
    staleness_stats,
)

__all__ = [
    "PIPELINE_MODES",
    "BatchCutting",
    "BatchEnd",
    "BatchStart",
    "BatchSummary",
    "GroupScoring",
    "MicroBatch",
    "OverlongShaping",
    "Pipeline",
    "PipelineError",
    "PipelineMode",
    "PipelineSettings",
    "PolicyVersions",
    "PromptSource",
    "RewardCallable",
    "RolloutInputs",
    "Sample",
    "ScoredGroup",
    "StalenessStats",
    "StepBatch",
    "StepSpan",
    "VersionSchedule",
    "failed_group",
    "make_micro_batch",
    "request_id",
    "request_seed",
    "sample_from",
    "score_group",
    "split_group",
    "staleness_stats",
    "summarize",
    "to_token_group",
]
