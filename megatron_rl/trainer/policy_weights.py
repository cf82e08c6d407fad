"""The policy as the weight sync reads it: ``PolicyWeights`` (a ``weight_sync.WeightSource``)
and ``stage_place`` (where this rank sits, from megatron-core's parallel state).

The senders themselves (``megatron_rl.weight_sync``) know nothing of megatron: they get
HF-named tensors of this rank's stage (``export``: TP shards gathered over the stage's TP
group) or a HF checkpoint written by every rank (``save``).

Only the rank that sends a stage (``StagePlace.sends``: TP rank 0 of DP replica 0) holds the
stage's full tensors: the other TP ranks of replica 0 send their shards to it one parameter at
a time and keep nothing; other replicas take part only in the routed experts' gathers (their
EP group spans replicas), and a replica outside the first expert-data-parallel group in none.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.models import DecoderSpec, save_hf_checkpoint
from megatron_rl.models.convert import EXPERT_KINDS
from megatron_rl.models.hf_io import export_items, gather_hf
from megatron_rl.weight_sync import StagePlace


class PolicyWeights:
    """``WeightSource`` over this rank's megatron policy."""

    def __init__(self, policy, spec: DecoderSpec, source_dir: str | Path) -> None:
        self.policy, self.spec, self.source_dir = policy, spec, Path(source_dir)

    def export(self) -> list[tuple[str, torch.Tensor]]:
        """This stage's HF tensors on the rank that sends it; [] on the others (module doc).
        Collective over the stage's TP group of DP replica 0 (routed experts: their TP x EP group)."""
        from megatron.core import parallel_state as ps

        first_dp, first_edp = ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0
        out: list[tuple[str, torch.Tensor]] = []
        for item in export_items(self.policy, self.spec):
            if not (first_edp if item.rule.kind in EXPERT_KINDS else first_dp):
                continue  # another replica's copy: replica 0 exports it
            full = gather_hf(item, item.param.detach(), self.spec)  # None but on the sending rank
            if full is not None and first_dp:
                out.extend(zip(item.names, full, strict=True))
        return out

    def save(self, directory: Path) -> None:
        """A HF checkpoint of the policy in ``directory`` (collective over the world)."""
        save_hf_checkpoint(self.policy, self.spec, directory, source_dir=self.source_dir)


def stage_place() -> StagePlace:
    """This rank's pipeline stage, whether it sends the stage (TP rank 0), its DP replica."""
    from megatron.core import parallel_state as ps

    return StagePlace(
        stage=ps.get_pipeline_model_parallel_rank(),
        stages=ps.get_pipeline_model_parallel_world_size(),
        sender=ps.get_tensor_model_parallel_rank() == 0,
        dp_rank=ps.get_data_parallel_rank(),
    )
