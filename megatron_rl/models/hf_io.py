"""Read HF safetensors checkpoints lazily, load them into megatron shards, save shards back as HF.

Saving is atomic: shards are written into ``<out>.tmp`` and renamed into place only after
every rank has finished, so an interrupted save leaves no half-written checkpoint. Saving
streams one tensor at a time (``export_items`` / ``gather_hf`` / ``safetensors_stream``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_rl.models.convert import (
    EXPERT_KINDS,
    ParamRule,
    ShardInfo,
    hf_names,
    iter_export,
    load_shards_into,
    match_rule,
    shards_to_hf,
)
from megatron_rl.models.hf_config import DecoderSpec
from megatron_rl.models.safetensors_stream import SafetensorsStream, TensorEntry
from megatron_rl.parallel.gather import host_barrier, host_group

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Files copied next to exported weights so the directory is a loadable HF checkpoint.
_SIDECARS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


class HFCheckpointReader:
    """Lazily reads tensors by name from a (possibly sharded) safetensors HF checkpoint."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / _INDEX
        if index.is_file():
            self.file_of = {k: self.path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        elif (self.path / _SINGLE).is_file():
            with safe_open(self.path / _SINGLE, "pt") as f:
                self.file_of = {k: self.path / _SINGLE for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.path}: no {_SINGLE} or {_INDEX} (only safetensors checkpoints are supported)"
            )
        self._handles: dict[Path, object] = {}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise KeyError(f"{self.path}: checkpoint has no tensor {name!r}")
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file].get_tensor(name)

    def names(self) -> list[str]:
        return sorted(self.file_of)


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this PP stage's first decoder layer."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def expert_parallel_size() -> int:
    """megatron's expert-parallel size (1 for a dense model)."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()


def shard_info(model: torch.nn.Module) -> ShardInfo:
    """Where this rank's shard of ``model`` sits (TP, EP, padded vocabulary)."""
    from megatron.core import parallel_state

    return ShardInfo(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        padded_vocab=model.vocab_size,
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=expert_parallel_size(),
    )


def load_hf_weights(model: torch.nn.Module, hf_path: str | Path, spec: DecoderSpec) -> None:
    """Fill this rank's TP/EP/PP shard of ``model`` from the HF checkpoint at ``hf_path``."""
    shard = shard_info(model)
    reader = HFCheckpointReader(hf_path)
    load_shards_into(model, lambda n: reader(n).to(torch.float32), spec, shard, layer_offset(model))
    # load_shards_into copies into params of the model's dtype; the fp32 detour keeps it exact.


def export_hf_tensors(model: torch.nn.Module, spec: DecoderSpec):
    """Iterate (HF name, full tensor) over this PP stage's parameters, TP shards gathered and
    routed experts over EP (on every rank; ``save_hf_checkpoint`` gathers to the writer only)."""
    from megatron_rl.parallel.gather import gather_experts, gather_tp

    return iter_export(
        model,
        gather_tp,
        spec,
        layer_offset=layer_offset(model),
        gather_experts=gather_experts,
        ep=expert_parallel_size(),
    )


# megatron_rl.lora's adapter parameters: ``<linear>.lora.parts.<projection>.lora_A / lora_B``
_LORA = ".lora.parts."


@dataclass(frozen=True)
class ExportItem:
    """One megatron parameter of this PP stage as the HF tensors it exports to."""

    param: torch.nn.Parameter
    rule: ParamRule
    names: tuple[str, ...]  # HF names
    shapes: tuple[tuple[int, ...], ...]  # their full (TP-gathered) shapes


def export_items(model: torch.nn.Module, spec: DecoderSpec) -> list[ExportItem]:
    """This stage's parameters in export order, the tied output layer and LoRA adapters left out
    (HF stores the former once, as the embedding; PEFT's files hold the latter). Shapes come from
    the conversion run on meta tensors: no data."""
    from megatron.core import parallel_state

    tp, offset, out = parallel_state.get_tensor_model_parallel_world_size(), layer_offset(model), []
    ep = expert_parallel_size()
    for name, param in model.named_parameters():
        if _LORA in name:
            continue
        rule, layer = match_rule(name, offset, ep)
        if rule.mcore == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        count = 1 if rule.kind == "replicated" else tp * (ep if rule.kind in EXPERT_KINDS else 1)
        meta = [torch.empty(param.shape, device="meta")] * count
        shapes = tuple(tuple(t.shape) for t in shards_to_hf(rule, meta, spec))
        out.append(ExportItem(param=param, rule=rule, names=hf_names(rule, layer, spec), shapes=shapes))
    return out


@dataclass(frozen=True)
class ExportSelection:
    """Which export items a HF checkpoint holds (``keep``) and the shard each is written from
    (``shard``: this rank's tensor of the item's parameter shape), e.g. a LoRA policy's merged
    adapted weights alone; without one, every item from its parameter."""

    keep: Callable[[ExportItem], bool]
    shard: Callable[[ExportItem], torch.Tensor]


def gather_hf(item: ExportItem, shard: torch.Tensor, spec: DecoderSpec) -> tuple[torch.Tensor, ...] | None:
    """The full HF tensors of ``item`` from every TP rank's ``shard`` (``item.param``'s shape),
    on TP rank 0; None on the others. Collective over the TP group; for a routed expert over
    the expert TP x EP group, to its first rank (the stage's writer when that is DP rank 0)."""
    from megatron.core import parallel_state

    from megatron_rl.parallel.gather import gather_experts_to_first, gather_tp_to_first

    if item.rule.kind in EXPERT_KINDS:
        shards = gather_experts_to_first(shard)
    elif item.rule.kind == "replicated":  # the same on every TP rank: no communication
        shards = [shard] if parallel_state.get_tensor_model_parallel_rank() == 0 else None
    else:
        shards = gather_tp_to_first(shard)
    return None if shards is None else shards_to_hf(item.rule, shards, spec)


def save_hf_checkpoint(
    model: torch.nn.Module,
    spec: DecoderSpec,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    select: ExportSelection | None = None,
) -> None:
    """Write the model as a sharded HF safetensors checkpoint (one file per PP stage), atomically.

    Collective over the whole world. Streamed: each tensor is gathered over TP to the stage's
    writer (DP rank 0 / TP rank 0), written and freed, so no rank holds more than about one
    full tensor (DP ranks > 0 hold nothing: the weights are the same on every replica).
    ``source_dir`` supplies config and tokenizer files; ``dtype`` casts on write (default: as is);
    ``select`` writes some tensors only, or others than the parameters (``ExportSelection``).
    """
    from megatron.core import parallel_state

    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    pp, pp_rank = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    writer = (
        parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    )
    # routed experts are gathered over EP, whose ranks sit in different DP replicas: every
    # rank of the first expert-DP replica takes part (only DP rank 0 in the dense tensors)
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    host_barrier()
    file = f"model-{pp_rank + 1:05d}-of-{pp:05d}.safetensors"
    names = (
        _write_stage(model, spec, tmp / file if writer else None, dtype, select)
        if (parallel_state.get_expert_data_parallel_rank() == 0)
        else []
    )
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (file, names) if writer else None, group=host_group())
    if rank0:
        _publish(tmp, out_dir, entries, source_dir)
    host_barrier()


def _publish(tmp: Path, out_dir: Path, entries: list, source_dir: str | Path | None) -> None:
    """Write the index of every stage's (file, names), copy the sidecars of ``source_dir`` and move
    the finished ``tmp`` directory to ``out_dir`` (rank 0)."""
    weight_map = {n: f for entry in entries if entry for f, ns in [entry] for n in ns}
    (tmp / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    for side in _SIDECARS if source_dir else ():
        if (Path(source_dir) / side).is_file():
            shutil.copy2(Path(source_dir) / side, tmp / side)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)


def _write_stage(
    model: torch.nn.Module,
    spec: DecoderSpec,
    path: Path | None,
    dtype: torch.dtype | None,
    select: ExportSelection | None,
) -> list[str]:
    """Stream this stage's weights (``select``'s) into ``path`` (None: this TP rank only sends its
    shards); returns the HF names written."""
    from megatron.core import parallel_state

    items = [it for it in export_items(model, spec) if select is None or select.keep(it)]
    entries = [
        TensorEntry(n, dtype or it.param.dtype, s) for it in items for n, s in zip(it.names, it.shapes, strict=True)
    ]
    first_dp = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    with SafetensorsStream(path, entries, {"format": "pt"}) if path is not None else nullcontext() as out:
        for item in items:
            if not first_dp and item.rule.kind not in EXPERT_KINDS:
                continue  # another replica's copy of a dense tensor: DP rank 0 writes it
            shard = item.param.detach() if select is None else select.shard(item)
            full = gather_hf(item, shard, spec)  # None on ranks other than the writer
            if full is not None:
                for name, tensor in zip(item.names, full, strict=True):
                    out.write(name, tensor if dtype is None else tensor.to(dtype))
            del full  # one parameter's tensors at a time
    return [e.name for e in entries]
