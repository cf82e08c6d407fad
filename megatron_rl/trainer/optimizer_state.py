"""Optimizer state per HF-named parameter: the checkpoint format that resumes on any layout.

megatron keeps Adam's state by *main* parameter: the model parameter itself (fp32 model), an
fp32 copy (bf16 model), or, with the distributed optimizer, a flat slice owned by one DP
rank. Here each model parameter's state is first made whole over DP (``param_state``: the
owners' slices summed into zeros, one all-reduce), then its TP shards are gathered and named
as the HF tensors of the weights (``models.convert``: the same QKV interleave, gate / up
split and vocabulary padding, all elementwise-safe), so the file is independent of TP, PP,
DP and the optimizer wrapper. Loading cuts it again for the resuming layout.

Files under ``<checkpoint>/optimizer/``::

    stage-00001-of-0000P.safetensors  "exp_avg/<hf name>", "exp_avg_sq/<hf name>" and, when
                                      the model is not fp32, "param/<hf name>" (fp32 master
                                      weights); one file per PP stage, written by its TP 0 / DP 0
    optimizer.json                    {"format", "step", "keys"}

Both directions are collective over the world; safetensors and JSON only (no pickle).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.models import DecoderSpec
from megatron_rl.models.convert import ShardInfo, hf_names, hf_to_shard, match_rule, shards_to_hf
from megatron_rl.models.hf_io import layer_offset
from megatron_rl.parallel.gather import gather_tp

FORMAT = "megatron_rl.optimizer.per_hf_parameter.v1"
META_FILE = "optimizer.json"
MOMENTS = ("exp_avg", "exp_avg_sq")


class _Access:
    """Get / set one model parameter's whole Adam state on this rank, whatever the wrapper."""

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

    def get(self, param: torch.nn.Parameter) -> tuple[dict[str, torch.Tensor], int]:
        """({"param", "exp_avg", "exp_avg_sq"}: fp32, ``param``'s shape; zeros where not stepped), step."""
        part, main = self.main[param]
        if main is None:
            return self._get_distributed(part, param)
        state = part.optimizer.state.get(main, {})
        out = {"param": main.detach().float()}
        for k in MOMENTS:
            out[k] = state[k].detach().float() if k in state else torch.zeros(param.shape, dtype=torch.float32)
        return out, int(state["step"]) if "step" in state else 0

    def set(self, param: torch.nn.Parameter, tensors: dict[str, torch.Tensor], step: int) -> None:
        """Write ``tensors`` (``param``'s shape; "param" optional) as ``param``'s state after ``step`` steps."""
        part, main = self.main[param]
        if main is None:
            return self._set_distributed(part, param, tensors, step)
        with torch.no_grad():
            if "param" in tensors:
                main.copy_(tensors["param"])
            part.optimizer.state[main] = {"step": torch.tensor(float(step)),
                                          **{k: tensors[k].to(main.dtype).clone() for k in MOMENTS}}

    @staticmethod
    def _get_distributed(part, param) -> tuple[dict[str, torch.Tensor], int]:
        """The owners' slices summed into whole tensors over the DP group."""
        whole = {k: torch.zeros(param.numel(), dtype=torch.float32) for k in ("param", *MOMENTS)}
        step = torch.zeros(1, dtype=torch.float64)
        if param in part.model_param_group_index_map:  # this DP rank owns a slice
            span = part._get_model_param_range_map(param)["param"]
            for k, v in part._get_main_param_and_optimizer_states(param).items():
                if k == "step":
                    step[0] = float(v)
                elif k in whole:
                    whole[k][span.start:span.end] = v.detach().float().view(-1)
        for t in whole.values():
            dist.all_reduce(t, group=part.data_parallel_group)
        dist.all_reduce(step, op=dist.ReduceOp.MAX, group=part.data_parallel_group)
        return {k: v.view(param.shape) for k, v in whole.items()}, int(step.item())

    @staticmethod
    def _set_distributed(part, param, tensors, step) -> None:
        if param not in part.model_param_group_index_map:
            return  # another DP rank owns all of it
        span = part._get_model_param_range_map(param)["param"]
        group_index, group_order = part.model_param_group_index_map[param]
        main = part.optimizer.param_groups[group_index]["params"][group_order]
        with torch.no_grad():
            if "param" in tensors:
                main.copy_(tensors["param"].reshape(-1)[span.start:span.end])
            part.optimizer.state[main] = {
                "step": torch.tensor(float(step)),
                **{k: tensors[k].reshape(-1)[span.start:span.end].to(main.dtype).clone() for k in MOMENTS}}


def _named_params(model) -> Iterator[tuple[str, torch.nn.Parameter, object, int | None]]:
    """(megatron name, parameter, conversion rule, global layer) of this PP stage."""
    offset = layer_offset(model)
    for name, param in model.named_parameters():
        rule, layer = match_rule(name, offset)
        yield name, param, rule, layer


def save_optimizer_state(optimizer, model, spec: DecoderSpec, directory: str | Path) -> None:
    """Write the state of ``optimizer`` (over ``model``'s parameters) into ``directory``; see
    the module doc. Collective over the world."""
    from megatron.core import parallel_state as ps

    access, out, steps = _Access(optimizer), {}, [0]
    keys = MOMENTS if all(p.dtype == torch.float32 for p in model.parameters()) else ("param", *MOMENTS)
    for _, param, rule, layer in _named_params(model):
        state, step = access.get(param)
        steps.append(step)
        if rule.mcore == "output_layer.weight" and spec.tie_word_embeddings:
            continue  # stored once, as the embedding (its state is the embedding's)
        for key in keys:
            shards = [state[key]] if rule.kind == "replicated" else gather_tp(state[key])
            names = hf_names(rule, layer, spec)
            out.update((f"{key}/{n}", t.contiguous()) for n, t in zip(names, shards_to_hf(rule, shards, spec),
                                                                      strict=True))
    step = torch.tensor([max(steps)], dtype=torch.int64)
    dist.all_reduce(step, op=dist.ReduceOp.MAX)
    directory = Path(directory)
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(out, str(directory / f"stage-{stage + 1:05d}-of-{pp:05d}.safetensors"), metadata={"format": "pt"})
    if dist.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / META_FILE).write_text(json.dumps({"format": FORMAT, "step": int(step.item()), "keys": keys}))


def is_resharding_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / META_FILE).is_file()


def load_optimizer_state(optimizer, model, spec: DecoderSpec, directory: str | Path) -> None:
    """Restore ``optimizer`` for this rank's shard of ``model`` from ``directory`` (written at
    any layout). Raises ``ValueError`` naming the file or tensor when it does not fit."""
    from megatron.core import parallel_state as ps

    directory = Path(directory)
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{directory / META_FILE}: format {meta.get('format')!r}, expected {FORMAT!r}")
    handles = [safe_open(str(f), "pt") for f in sorted(directory.glob("stage-*.safetensors"))]
    file_of = {name: h for h in handles for name in h.keys()}
    shard = ShardInfo(tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                      padded_vocab=model.vocab_size)
    access = _Access(optimizer)
    for name, param, rule, layer in _named_params(model):
        tensors = {}
        for key in meta["keys"]:
            wanted = [f"{key}/{n}" for n in hf_names(rule, layer, spec)]
            if missing := [w for w in wanted if w not in file_of]:
                raise ValueError(f"{directory}: no optimizer state {missing[0]!r} for parameter {name}")
            tensors[key] = hf_to_shard(rule, [file_of[w].get_tensor(w) for w in wanted], spec, shard)
            if tensors[key].shape != param.shape:
                raise ValueError(f"{directory}: optimizer state of {name} has shape {tuple(tensors[key].shape)}, "
                                 f"the model expects {tuple(param.shape)}")
        access.set(param, tensors, int(meta["step"]))
