"""The policy as the weight sync reads it: ``PolicyWeights`` (a ``weight_sync.WeightSource``)
and ``stage_place`` (where this rank sits, from megatron-core's parallel state).

The senders themselves (``megatron_rl.weight_sync``) know nothing of megatron: they get
HF-named tensors of this rank's stage (``export``: TP shards gathered over the stage's TP
group) or a HF checkpoint written by every rank (``save``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.models import DecoderSpec, export_hf_tensors, save_hf_checkpoint
from megatron_rl.weight_sync import StagePlace


class PolicyWeights:
    """``WeightSource`` over this rank's megatron policy."""

    def __init__(self, policy, spec: DecoderSpec, source_dir: str | Path) -> None:
        self.policy, self.spec, self.source_dir = policy, spec, Path(source_dir)

    def export(self) -> list[tuple[str, torch.Tensor]]:
        """This stage's HF tensors (collective over the stage's TP group)."""
        return list(export_hf_tensors(self.policy, self.spec))

    def save(self, directory: Path) -> None:
        """A HF checkpoint of the policy in ``directory`` (collective over the world)."""
        save_hf_checkpoint(self.policy, self.spec, directory, source_dir=self.source_dir)


def stage_place() -> StagePlace:
    """This rank's pipeline stage, whether it sends the stage (TP rank 0), its DP replica."""
    from megatron.core import parallel_state as ps

    return StagePlace(stage=ps.get_pipeline_model_parallel_rank(), stages=ps.get_pipeline_model_parallel_world_size(),
                      sender=ps.get_tensor_model_parallel_rank() == 0, dp_rank=ps.get_data_parallel_rank())
