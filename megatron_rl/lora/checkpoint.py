"""LoRA checkpoints in PEFT's format, and the merged model as a HF checkpoint.

``save_peft_adapter`` writes ``adapter_config.json`` + ``adapter_model.safetensors`` as
``PeftModel.save_pretrained`` does (PEFT's tensor names, float32 tensors as PEFT keeps adapters
of a float32 or bfloat16 base, metadata ``{"format": "pt"}``, ``r`` / ``lora_alpha`` /
``lora_dropout`` / ``target_modules`` by HF module name, ``task_type`` CAUSAL_LM), so
``PeftModel.from_pretrained(hf_base, directory)`` loads it. Every PP stage's writer (TP 0 of DP
replica 0) gathers its adapters over TP into a file of its own; global rank 0 then joins the
stages' files into the one PEFT file. ``load_peft_adapter`` reads it back into any TP / PP
layout. ``merged_into_base`` shows the model as its plain base with ``W + scale * B A`` in the
adapted weights, for ``models.save_hf_checkpoint`` (``save_merged_checkpoint``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_rl.lora import peft_map
from megatron_rl.lora.apply import lora_adapters
from megatron_rl.lora.peft_map import load_peft_tensors
from megatron_rl.models.hf_config import DecoderSpec
from megatron_rl.models.safetensors_stream import SafetensorsStream, TensorEntry
from megatron_rl.parallel.gather import gather_tp_to_first, host_barrier, host_group

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
SAVED_DTYPE = torch.float32  # PEFT's: adapters of a bfloat16 / float16 base are kept (and saved) in float32


@dataclass(frozen=True)
class AdapterTensor:
    """One adapter tensor of this rank: the parameter, its PEFT name, the dim TP splits it along
    (None: the same on every TP rank)."""

    param: torch.nn.Parameter
    name: str
    split_dim: int | None

    def full_shape(self, tp: int) -> tuple[int, ...]:
        """The shape of the whole tensor (every TP rank's shard joined)."""
        shape = list(self.param.shape)
        if self.split_dim is not None:
            shape[self.split_dim] *= tp
        return tuple(shape)

    def gather(self, shard: torch.Tensor) -> torch.Tensor | None:
        """The whole tensor from every TP rank's ``shard`` (this parameter's shape), on TP rank 0;
        None on the others. Collective over the TP group when split."""
        from megatron.core import parallel_state as ps

        if self.split_dim is None:
            return shard if ps.get_tensor_model_parallel_rank() == 0 else None
        shards = gather_tp_to_first(shard)
        return None if shards is None else torch.cat(shards, dim=self.split_dim)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's shard of the whole tensor ``full``."""
        from megatron.core import parallel_state as ps

        if self.split_dim is None:
            return full
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        return full.chunk(tp, dim=self.split_dim)[rank]


def adapter_tensors(model: torch.nn.Module) -> list[AdapterTensor]:
    """This PP stage's adapter tensors in a fixed order (empty for a model without adapters)."""
    return [AdapterTensor(p, name, dim) for p, name, dim in peft_map.adapter_tensors(model)]


def has_adapters(model: torch.nn.Module) -> bool:
    """Whether ``model`` (this rank's stage) carries LoRA adapters."""
    return next(lora_adapters(model), None) is not None


def _stage_config(model: torch.nn.Module) -> dict:
    """r, lora_alpha, lora_dropout and the HF module names adapted on this stage."""
    adapters = list(lora_adapters(model))
    parts = [p for a in adapters for p in a.parts.values()]
    rank, scale, dropout = parts[0].lora_A.shape[0], adapters[0].scale, adapters[0].dropout
    if any(a.scale != scale or a.dropout != dropout for a in adapters) or any(p.lora_A.shape[0] != rank for p in parts):
        raise ValueError("LoRA adapters of one model differ in rank, scale or dropout: PEFT's format has one of each")
    alpha = float(f"{scale * rank:.12g}")
    return {
        "r": rank,
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({p.hf_name.rsplit(".", 1)[-1] for p in parts}),
    }


def peft_config(stage_configs: list[dict], base_path: str) -> dict:
    """``adapter_config.json``'s fields (PEFT's names and defaults) from every stage's ``_stage_config``."""
    first = stage_configs[0]
    for other in stage_configs[1:]:
        if {k: v for k, v in other.items() if k != "target_modules"} != {
            k: v for k, v in first.items() if k != "target_modules"
        }:
            raise ValueError(f"PP stages disagree on the LoRA settings: {first} vs {other}")
    targets = sorted({t for c in stage_configs for t in c["target_modules"]})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        **first,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def save_peft_adapter(model: torch.nn.Module, directory: str | Path, *, base_path: str | Path) -> None:
    """Write ``model``'s adapters into ``directory`` in PEFT's format (module doc), recording
    ``base_path`` as ``base_model_name_or_path``. Collective over the world."""
    from megatron.core import parallel_state as ps

    directory = Path(directory)
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    host_barrier()
    part = directory / f"{WEIGHTS_FILE}.stage-{stage + 1:05d}-of-{pp:05d}"
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:  # adapters are the same on every DP replica
        _write_stage(model, part if writer else None)
    entries: list = [None] * dist.get_world_size()
    dist.all_gather_object(entries, (part.name, _stage_config(model)) if writer else None, group=host_group())
    if dist.get_rank() == 0:
        stages = sorted({e[0]: e[1] for e in entries if e}.items())
        tensors: dict[str, torch.Tensor] = {}
        for name, _ in stages:
            tensors.update(load_file(directory / name))
            (directory / name).unlink()
        save_file(dict(sorted(tensors.items())), directory / WEIGHTS_FILE, metadata={"format": "pt"})
        config = peft_config([c for _, c in stages], str(base_path))
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    host_barrier()


def _write_stage(model: torch.nn.Module, path: Path | None) -> None:
    """This stage's adapters, gathered over TP, streamed into ``path`` (None: only send shards)."""
    from megatron.core import parallel_state as ps

    tensors, tp = adapter_tensors(model), ps.get_tensor_model_parallel_world_size()
    entries = [TensorEntry(t.name, SAVED_DTYPE, t.full_shape(tp)) for t in tensors]
    with SafetensorsStream(path, entries, {"format": "pt"}) if path is not None else nullcontext() as out:
        for t in tensors:
            full = t.gather(t.param.detach())
            if full is not None:
                out.write(t.name, full.to(SAVED_DTYPE))


class _LazyTensors(Mapping):
    """A safetensors file as a read-on-demand mapping of name -> tensor."""

    def __init__(self, path: Path):
        self.handle = safe_open(str(path), "pt")
        self.names = set(self.handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.names))

    def __len__(self) -> int:
        return len(self.names)


def load_peft_adapter(model: torch.nn.Module, directory: str | Path) -> None:
    """Load a PEFT adapter directory (ours or ``PeftModel.save_pretrained``'s) into this rank's
    shards of ``model``'s adapters; ``ValueError`` naming the file and field when its r,
    lora_alpha or lora_dropout are not the model's, or a tensor is missing or misshapen."""
    directory = Path(directory)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / file).is_file():
            raise ValueError(f"{directory}: no {file} (not a PEFT adapter directory)")
    saved, ours = json.loads((directory / CONFIG_FILE).read_text()), _stage_config(model)
    for key in ("r", "lora_alpha", "lora_dropout"):
        if float(saved.get(key, -1)) != float(ours[key]):
            raise ValueError(
                f"{directory / CONFIG_FILE}: {key} {saved.get(key)!r}, the model's adapters have {ours[key]!r}"
            )
    try:
        load_peft_tensors(model, _LazyTensors(directory / WEIGHTS_FILE))
    except KeyError as err:
        raise ValueError(f"{directory / WEIGHTS_FILE}: {err.args[0]}") from err
    except ValueError as err:
        raise ValueError(f"{directory / WEIGHTS_FILE}: {err}") from err


@contextmanager
def merged_into_base(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block ``model`` looks like its base model (no adapter modules or parameters) with
    each adapted weight replaced by ``W + scale * B A`` (``lora.merged_weight``); restored on exit,
    the original weight tensors put back untouched. Do not run the model inside the block."""
    from megatron_rl.lora.adapter import merged_weight

    adapted = [m for m in model.modules() if "lora" in m._modules]
    saved = [(m, m._modules["lora"], m.weight.data) for m in adapted]
    try:
        for module, _, _ in saved:
            merged = merged_weight(module)
            del module._modules["lora"]
            module.weight.data = merged
        yield model
    finally:
        for module, adapter, weight in saved:
            module._modules["lora"] = adapter
            module.weight.data = weight


def save_merged_checkpoint(
    model: torch.nn.Module, spec: DecoderSpec, directory: str | Path, *, source_dir: str | Path
) -> None:
    """Write the merged model (``W + scale * B A``) as a HF checkpoint loadable by transformers,
    config and tokenizer from ``source_dir``. Collective over the world."""
    from megatron_rl.models import save_hf_checkpoint

    with merged_into_base(model):
        save_hf_checkpoint(model, spec, directory, source_dir=source_dir)
