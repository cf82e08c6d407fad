"""Optimizer state per HF-named parameter: the checkpoint format that resumes on any layout.

megatron keeps Adam's state by *main* parameter: the model parameter itself (fp32 model), an
fp32 copy (bf16 model), or, with the distributed optimizer, a flat slice owned by one DP
rank. Here each model parameter's state is first made whole over DP (``param_state``: the
owners' slices summed into zeros, one all-reduce), then its TP shards are gathered and named
as the HF tensors of the weights (``models.convert``: the same QKV interleave, gate / up
split and vocabulary padding, all elementwise-safe), so the file is independent of TP, PP,
DP and the optimizer wrapper. Loading cuts it again for the resuming layout. A LoRA policy
(``lora.checkpoint.has_adapters``) has state for its adapters only, named as PEFT names them
(``<key>/base_model.model.<HF module>.lora_A.weight``: TP shards joined along the dim TP splits).

Files under ``<checkpoint>/optimizer/``::

    stage-00001-of-0000P.safetensors  "exp_avg/<name>", "exp_avg_sq/<name>" and, when the
                                      trained weights are not fp32, "param/<name>" (fp32 master
                                      weights); one file per PP stage, written by its TP 0 / DP 0
    optimizer.json                    {"format", "step", "keys"}

"step" counts the optimizer steps taken, read where the optimizer keeps it: per parameter
(torch Adam / AdamW, ``state[p]["step"]``) or per parameter group (apex / Transformer Engine
``FusedAdam``, ``param_groups[i]["step"]``, what megatron-core builds when either is
installed); a lost step restarts Adam's bias correction 1 / (1 - beta^t) at t = 1.

Saving streams: one tensor at a time is made whole (a reduce over DP for the distributed
optimizer, point-to-point over TP) on its stage's writer only, written and freed, so no rank
holds much more than one full tensor. Both directions are collective over the world;
safetensors and JSON only (no pickle).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import nullcontext
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_rl.lora.checkpoint import adapter_tensors, has_adapters
from megatron_rl.models import DecoderSpec
from megatron_rl.models.convert import EXPERT_KINDS, hf_to_shard, load_names, match_rule
from megatron_rl.models.hf_io import expert_parallel_size, export_items, gather_hf, layer_offset, shard_info
from megatron_rl.models.safetensors_stream import SafetensorsStream, TensorEntry
from megatron_rl.parallel.gather import host_barrier, max_over_world

FORMAT = "megatron_rl.optimizer.per_hf_parameter.v1"
META_FILE = "optimizer.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


class _Access:
    """Get / set one model parameter's Adam state on this rank, whatever the wrapper: torch
    Adam / AdamW (step per parameter), apex / TE ``FusedAdam`` (step per parameter group),
    inside the float16 wrapper, the distributed optimizer and megatron's chained optimizer."""

    def __init__(self, optimizer) -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        self.parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
        self.main: dict[torch.nn.Parameter, tuple[object, torch.Tensor | None]] = {}  # None: distributed
        for part in self.parts:
            if isinstance(part, DistributedOptimizer):  # every parameter, owned here or not
                self.main.update((p, (part, None)) for buf in part.buffers for p in buf.params)
            elif hasattr(part, "float16_groups"):
                pairs = zip(chain(*part.float16_groups), chain(*part.fp32_from_float16_groups), strict=True)
                self.main.update((p, (part, m)) for p, m in pairs)
                self.main.update((p, (part, p)) for p in chain(*part.fp32_from_fp32_groups))
            else:
                self.main.update((p, (part, p)) for g in part.optimizer.param_groups for p in g["params"])

    def is_distributed(self, param: torch.nn.Parameter) -> bool:
        return self.main[param][1] is None

    def step(self) -> int:
        """Steps taken (0 before the first), the largest on this rank: torch Adam keeps
        ``state[p]["step"]``, FusedAdam ``param_groups[i]["step"]`` (not counted in empty groups)."""
        steps = [0]
        for part in self.parts:
            steps += [int(g["step"]) for g in part.optimizer.param_groups if g.get("step") is not None]
            steps += [int(s["step"]) for s in part.optimizer.state.values() if "step" in s]
        return max(steps)

    def set_step(self, step: int) -> None:
        """Make every part resume after ``step`` steps, where its optimizer keeps the count."""
        for part in self.parts:
            inner = part.optimizer
            if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                for group in inner.param_groups:  # capturable / fused torch Adam wants the step on the device
                    on_device = group.get("capturable") or group.get("fused")
                    for p in group["params"]:
                        if p in inner.state:
                            inner.state[p]["step"] = torch.tensor(float(step), device=p.device if on_device else None)
            else:  # apex / TE FusedAdam: bias correction reads the group's step
                for group in inner.param_groups:
                    group["step"] = step

    def local(self, param: torch.nn.Parameter, key: str) -> torch.Tensor | None:
        """``key`` ("param", "exp_avg", "exp_avg_sq") of this rank's shard of ``param``: fp32,
        ``param``'s shape and device, zeros where not stepped. The distributed optimizer's
        slices are summed to its DP group's rank 0 (collective over that group; None elsewhere)."""
        part, main = self.main[param]
        if main is None:
            return self._reduce_distributed(part, param, key)
        if key == "param":
            return main.detach().float()
        state = part.optimizer.state.get(main, {})
        return state[key].detach().float() if key in state else torch.zeros(param.shape, device=param.device)

    def set(self, param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``tensors`` (``param``'s shape, any device; "param" optional) as ``param``'s state;
        the step is ``set_step``'s."""
        part, main = self.main[param]
        if main is None:
            return self._set_distributed(part, param, tensors)
        with torch.no_grad():
            if "param" in tensors:
                main.copy_(tensors["param"])
            part.optimizer.state[main] = {k: torch.empty_like(main).copy_(tensors[k]) for k in MOMENTS}

    @staticmethod
    def _reduce_distributed(part, param, key) -> torch.Tensor | None:
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        if param in part.model_param_group_index_map:  # this DP rank owns a slice
            span = part._get_model_param_range_map(param)["param"]
            value = part._get_main_param_and_optimizer_states(param).get(key)
            if value is not None:
                whole[span.start : span.end] = value.detach().view(-1)
        group = part.data_parallel_group
        first = dist.get_global_rank(group, 0)
        if dist.get_world_size(group) > 1:  # each element has one owner: a sum of it and zeros
            dist.reduce(whole, dst=first, group=group)
        return whole.view(param.shape) if dist.get_rank() == first else None

    @staticmethod
    def _set_distributed(part, param, tensors) -> None:
        if param not in part.model_param_group_index_map:
            return  # another DP rank owns all of it
        span = part._get_model_param_range_map(param)["param"]
        group_index, group_order = part.model_param_group_index_map[param]
        main = part.optimizer.param_groups[group_index]["params"][group_order]
        with torch.no_grad():
            if "param" in tensors:
                main.copy_(tensors["param"].reshape(-1)[span.start : span.end])
            part.optimizer.state[main] = {
                k: torch.empty_like(main).copy_(tensors[k].reshape(-1)[span.start : span.end]) for k in MOMENTS
            }


def _named_params(model) -> Iterator[tuple[str, torch.nn.Parameter, object, int | None]]:
    """(megatron name, parameter, conversion rule, global layer) of this PP stage."""
    offset, ep = layer_offset(model), expert_parallel_size()
    for name, param in model.named_parameters():
        rule, layer = match_rule(name, offset, ep)
        yield name, param, rule, layer


def save_optimizer_state(optimizer, model, spec: DecoderSpec, directory: str | Path) -> None:
    """Write the state of ``optimizer`` (over ``model``'s parameters; with LoRA, its adapters',
    by PEFT name) into ``directory``; see the module doc. Collective over the world; returns once
    every file is written. Streamed: each tensor is made whole over DP and TP on its stage's
    writer (TP 0 / DP 0), written, freed."""
    from megatron.core import parallel_state as ps

    access = _Access(optimizer)
    trained = [p for p in model.parameters() if p.requires_grad] if has_adapters(model) else model.parameters()
    keys = MOMENTS if all(p.dtype == torch.float32 for p in trained) else ("param", *MOMENTS)
    step = max_over_world(access.step())
    directory = Path(directory)
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    writer = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"stage-{stage + 1:05d}-of-{pp:05d}.safetensors"
    write = _write_adapter_state if has_adapters(model) else _write_model_state
    write(access, model, spec, path if writer else None, keys)
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / META_FILE).write_text(json.dumps({"format": FORMAT, "step": step, "keys": keys}))
    host_barrier()  # on return, on every rank, the directory is complete


def _write_model_state(access: _Access, model, spec: DecoderSpec, path: Path | None, keys) -> None:
    """Every parameter's state of this stage, by HF name, into ``path`` (None: not the writer)."""
    from megatron.core import parallel_state as ps

    first_dp = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    first_edp = ps.get_expert_data_parallel_rank() == 0  # routed experts: gathered over EP from every DP replica
    items = export_items(model, spec)
    entries = [
        TensorEntry(f"{key}/{n}", torch.float32, s)
        for it in items
        for key in keys
        for n, s in zip(it.names, it.shapes, strict=True)
    ]
    with SafetensorsStream(path, entries, {"format": "pt"}) if path is not None else nullcontext() as out:
        for item in items:
            first = first_edp if item.rule.kind in EXPERT_KINDS else first_dp  # of the parameter's DP group
            for key in keys:
                # non-distributed state is the same on every DP rank: DP rank 0 alone sends it
                shard = access.local(item.param, key) if first or access.is_distributed(item.param) else None
                full = gather_hf(item, shard, spec) if first else None  # the TP (experts: TP x EP) gather
                if full is not None:
                    for name, tensor in zip(item.names, full, strict=True):
                        out.write(f"{key}/{name}", tensor)
                del shard, full  # one tensor at a time


def _write_adapter_state(access: _Access, model, spec: DecoderSpec, path: Path | None, keys) -> None:
    """Every adapter tensor's state of this stage, by PEFT name, into ``path`` (None: not the
    writer); the frozen base has none."""
    from megatron.core import parallel_state as ps

    first_dp, tensors = ps.get_data_parallel_rank(with_context_parallel=True) == 0, adapter_tensors(model)
    tp = ps.get_tensor_model_parallel_world_size()
    entries = [TensorEntry(f"{key}/{t.name}", torch.float32, t.full_shape(tp)) for t in tensors for key in keys]
    with SafetensorsStream(path, entries, {"format": "pt"}) if path is not None else nullcontext() as out:
        for t in tensors:
            for key in keys:
                shard = access.local(t.param, key) if first_dp or access.is_distributed(t.param) else None
                full = t.gather(shard) if first_dp else None
                if full is not None:
                    out.write(f"{key}/{t.name}", full)
                del shard, full


def is_resharding_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / META_FILE).is_file()


def load_optimizer_state(optimizer, model, spec: DecoderSpec, directory: str | Path) -> None:
    """Restore ``optimizer`` for this rank's shard of ``model`` from ``directory`` (written at
    any layout). Raises ``ValueError`` naming the file or tensor when it does not fit."""
    directory = Path(directory)
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory / META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
    handles = [safe_open(str(f), "pt") for f in sorted(directory.glob("stage-*.safetensors"))]
    file_of = {name: h for h in handles for name in h.keys()}
    access = _Access(optimizer)
    if has_adapters(model):
        _load_adapter_state(access, model, meta["keys"], file_of=file_of, directory=directory)
    else:
        _load_model_state(access, model, spec, meta["keys"], file_of=file_of, directory=directory)
    access.set_step(int(meta["step"]))


def _load_model_state(access: _Access, model, spec: DecoderSpec, keys, *, file_of, directory: Path) -> None:
    """Set every parameter's state from the HF-named tensors of ``file_of``."""
    shard = shard_info(model)
    for name, param, rule, layer in _named_params(model):
        tensors = {}
        for key in keys:
            wanted = [f"{key}/{n}" for n in load_names(rule, layer, spec, shard)]
            if missing := [w for w in wanted if w not in file_of]:
                raise ValueError(f"{directory}: no optimizer state {missing[0]!r} for parameter {name}")
            tensors[key] = hf_to_shard(rule, [file_of[w].get_tensor(w) for w in wanted], spec, shard)
            _check_shape(directory, name, tensors[key], param)
        access.set(param, tensors)


def _load_adapter_state(access: _Access, model, keys, *, file_of, directory: Path) -> None:
    """Set every adapter tensor's state from the PEFT-named tensors of ``file_of``."""
    for t in adapter_tensors(model):
        tensors = {}
        for key in keys:
            if (wanted := f"{key}/{t.name}") not in file_of:
                raise ValueError(f"{directory}: no optimizer state {wanted!r} for adapter tensor {t.name}")
            tensors[key] = t.local(file_of[wanted].get_tensor(wanted))
            _check_shape(directory, t.name, tensors[key], t.param)
        access.set(t.param, tensors)


def _check_shape(directory: Path, name: str, value: torch.Tensor, param: torch.nn.Parameter) -> None:
    if value.shape != param.shape:
        raise ValueError(
            f"{directory}: optimizer state of {name} has shape {tuple(value.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
