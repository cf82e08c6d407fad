"""Periodic asynchrony: a producer thread feeds scored groups through a bounded queue to the
consumer, which trains them as they arrive and syncs weights once per batch.

Modules: `records` (Sample, ScoredGroup, BatchEnd, MicroBatch and the one conversion to
tensors), `versions` (which policy version may generate which batch; staleness), `producer`
(the thread: prompts -> engine -> rewards -> advantages -> queue), `consumer` (`Pipeline`:
queue -> micro-batches -> `TrainerStep` -> finish_batch -> publish version; shutdown).
"""

from megatron_rl.pipeline.consumer import BatchSummary, Pipeline, PipelineSettings, StepReport, TrainerStep
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
    MicroBatch,
    PipelineError,
    Sample,
    ScoredGroup,
    make_micro_batch,
    request_id,
    request_seed,
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
    "StepReport",
    "TrainerStep",
    "VersionSchedule",
    "make_micro_batch",
    "request_id",
    "request_seed",
    "score_group",
    "staleness_stats",
    "to_token_group",
]
