"""The policy as the weight sync reads it: ``PolicyWeights`` (a ``weight_sync.WeightSource``)
and ``stage_place`` (where this rank sits, from megatron-core's parallel state).

The senders themselves (``megatron_rl.weight_sync``) know nothing of megatron: they get
HF-named tensors of this rank's stage (``export``: TP shards gathered over the stage's TP
group) or a HF checkpoint written by every rank (``save``).

Only the rank that sends a stage (``StagePlace.sends``: TP rank 0 of DP replica 0) holds the
stage's full tensors: the other TP ranks of replica 0 send their shards to it one parameter at
a time and keep nothing; other replicas take part only in the routed experts' gathers (their
EP group spans replicas), and a replica outside the first expert-data-parallel group in none.

With LoRA (``megatron_rl.lora``: adapters on the policy, every other weight frozen) a sync is
*partial* (``partial``): ``export`` and ``save`` hold the adapted linears' merged weights
``W + scale * B A`` alone, each shard merged on its TP rank and gathered and converted as the
base weight is (``linear_qkv`` -> q / k / v, ``linear_fc1`` -> gate / up); the frozen weights
are never resent, since the engines start from the base checkpoint, which holds them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.lora import LoraAdapter, merged_weight
from megatron_rl.models import DecoderSpec, save_hf_checkpoint
from megatron_rl.models.convert import EXPERT_KINDS
from megatron_rl.models.hf_io import ExportItem, ExportSelection, export_items, gather_hf
from megatron_rl.weight_sync import StagePlace


class PolicyWeights:
    """``WeightSource`` over this rank's megatron policy."""

    def __init__(self, policy, spec: DecoderSpec, source_dir: str | Path) -> None:
        self.policy, self.spec, self.source_dir = policy, spec, Path(source_dir)

    @property
    def partial(self) -> bool:
        """A LoRA policy: only the adapted linears' merged weights are sent (module doc)."""
        return bool(_adapted(self.policy))

    def selection(self) -> ExportSelection | None:
        """What a sync sends of this stage: with LoRA the adapted linears' merged shards, else
        None (every parameter as it is)."""
        adapted = _adapted(self.policy)
        if not adapted:
            return None
        return ExportSelection(
            keep=lambda item: id(item.param) in adapted, shard=lambda item: merged_weight(adapted[id(item.param)])
        )

    def export(self) -> list[tuple[str, torch.Tensor]]:
        """This stage's HF tensors on the rank that sends it; [] on the others (module doc).
        Collective over the stage's TP group of DP replica 0 (routed experts: their TP x EP group)."""
        from megatron.core import parallel_state as ps

        first_dp, first_edp = (
            ps.get_data_parallel_rank(with_context_parallel=True) == 0,
            ps.get_expert_data_parallel_rank() == 0,
        )
        select, out = self.selection(), []
        for item in export_items(self.policy, self.spec):
            if not (first_edp if item.rule.kind in EXPERT_KINDS else first_dp):
                continue  # another replica's copy: replica 0 exports it
            if select is not None and not select.keep(item):
                continue  # frozen: the engines have it
            full = gather_hf(item, _shard(item, select), self.spec)  # None but on the sending rank
            if full is not None and first_dp:
                out.extend(zip(item.names, full, strict=True))
        return out

    def save(self, directory: Path) -> None:
        """A HF checkpoint of the policy in ``directory`` (collective over the world); with LoRA
        of the merged adapted weights alone."""
        save_hf_checkpoint(self.policy, self.spec, directory, source_dir=self.source_dir, select=self.selection())


def _adapted(policy: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The LoRA-adapted linears of this stage by ``id`` of their base weight (empty: no LoRA)."""
    return {id(m.weight): m for m in policy.modules() if isinstance(getattr(m, "lora", None), LoraAdapter)}


def _shard(item: ExportItem, select: ExportSelection | None) -> torch.Tensor:
    return item.param.detach() if select is None else select.shard(item)


def stage_place() -> StagePlace:
    """This rank's pipeline stage, whether it sends the stage (TP rank 0), its DP replica."""
    from megatron.core import parallel_state as ps

    return StagePlace(
        stage=ps.get_pipeline_model_parallel_rank(),
        stages=ps.get_pipeline_model_parallel_world_size(),
        sender=ps.get_tensor_model_parallel_rank() == 0,
        dp_rank=ps.get_data_parallel_rank(with_context_parallel=True),  # CP peers hold the same weights
    )
