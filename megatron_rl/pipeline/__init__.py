"""Periodic asynchrony: a producer thread feeds scored groups through a bounded queue to the
consumer, which trains them as they arrive and syncs weights once per batch.

Modules: `records` (Sample, ScoredGroup, BatchStart / BatchEnd, MicroBatch and the one
conversion to tensors), `versions` (which policy version may generate which batch;
staleness), `producer` (the thread: prompts -> engine -> rewards -> advantages -> queue;
it owns the group-size controller), `batching` (a step's groups -> mini-batches in prompt
order -> micro-batches under the token budget), `consumer` (`Pipeline`: begin_step ->
micro-batches for the trainer -> complete(new version) -> publish; shutdown).
"""

from megatron_rl.pipeline.batching import StepBatch
from megatron_rl.pipeline.consumer import BatchSummary, Pipeline, PipelineSettings, summarize
from megatron_rl.pipeline.producer import (
    Detokenize,
    GroupScoring,
    OverlongShaping,
    PromptItem,
    PromptSource,
    RewardCallable,
    score_group,
)
from megatron_rl.pipeline.records import (
    BatchEnd,
    BatchStart,
    MicroBatch,
    PipelineError,
    Sample,
    ScoredGroup,
    make_micro_batch,
    request_id,
    request_seed,
    split_group,
    to_token_group,
)
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
    "BatchEnd",
    "BatchStart",
    "BatchSummary",
    "Detokenize",
    "GroupScoring",
    "MicroBatch",
    "OverlongShaping",
    "Pipeline",
    "PipelineError",
    "PipelineMode",
    "PipelineSettings",
    "PolicyVersions",
    "PromptItem",
    "PromptSource",
    "RewardCallable",
    "Sample",
    "ScoredGroup",
    "StalenessStats",
    "StepBatch",
    "VersionSchedule",
    "make_micro_batch",
    "request_id",
    "request_seed",
    "score_group",
    "split_group",
    "staleness_stats",
    "summarize",
    "to_token_group",
]
