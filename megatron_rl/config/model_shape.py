"""Rules on the ``model`` section that need the model: its sizes vs TP / PP, and the names the
``model.megatron`` pass-through may set.

Contract: `model_shape(cfg, hf_config)` reads the sizes TP / PP must divide from
``<model.hf_path>/config.json`` (that file only; `hf_config` may stand in for it);
`parallel_fit(sizes, num_layers, tp, pp)` says why TP / PP cannot shard them (also used by
``models/`` and ``plan/``); `check_megatron_passthrough(megatron)` refuses names that are not
megatron-core ``TransformerConfig`` fields or that this project sets itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import suggest
from .schema import Config

Found = Iterator[tuple[str, str]]  # (dotted key, message) pairs yielded by a check

# TransformerConfig fields built from the HF config.json by models/.
HF_OWNED = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "layernorm_epsilon",
    "normalization",
)
# TransformerConfig fields this project sets itself; the value says from where.
MEGATRON_OWNED = {
    "tensor_model_parallel_size": "parallel.tp",
    "pipeline_model_parallel_size": "parallel.pp",
    "context_parallel_size": "parallel.cp",
    "expert_model_parallel_size": "parallel.ep",
    "moe_aux_loss_coeff": "model.moe.aux_loss_coeff",
    "moe_z_loss_coeff": "model.moe.z_loss_coeff",
    "moe_router_load_balancing_type": "model.moe.load_balancing",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "params_dtype": "model.dtype",
    **dict.fromkeys(HF_OWNED, "model.hf_path's config.json"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of the HF model that parallelism must divide."""

    source: str  # where they were read, for messages: "<hf_path>/config.json"
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (megatron: num_query_groups)
    ffn_hidden: int | None  # intermediate_size, None when absent (e.g. MoE configs)
    num_experts: int | None = None  # routed experts of a MoE model (num_experts / num_local_experts), None: dense


def check_megatron_passthrough(megatron: Mapping[str, Any]) -> Found:
    """model.megatron names must be TransformerConfig fields this project does not set itself."""
    if not megatron:
        return
    known = megatron_field_names()
    for name in megatron:
        key = f"model.megatron.{name}"
        if name in MEGATRON_OWNED:
            yield key, f"is set from {MEGATRON_OWNED[name]}; remove it here"
        elif name not in known:
            yield key, f"not a megatron-core TransformerConfig field ({suggest(name, known)})"


@functools.cache
def megatron_field_names() -> frozenset[str]:
    """Init-field names of megatron-core's TransformerConfig (imported lazily: it pulls torch)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return frozenset(f.name for f in dataclasses.fields(TransformerConfig) if f.init)


def model_shape(cfg: Config, hf_config: dict[str, Any] | None) -> tuple[ModelShape | None, list[tuple[str, str]]]:
    """Read the sizes TP/PP must divide from `hf_config` or ``<model.hf_path>/config.json``."""
    source = f"{cfg.model.hf_path}/config.json"
    if hf_config is None:
        hf_config, why = read_hf_json(Path(cfg.model.hf_path))
        if hf_config is None:
            return None, [("model.hf_path", why)]
    hf = hf_config.get("text_config", hf_config)  # multimodal configs nest the language model
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if not isinstance(hf.get(k), int)]
    if missing:
        return None, [("model.hf_path", f"{source} lacks integer {', '.join(missing)}")]
    heads = hf["num_attention_heads"]
    shape = ModelShape(
        source=source,
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden=hf.get("intermediate_size"),
        num_experts=hf.get("num_experts") or hf.get("num_local_experts") or hf.get("n_routed_experts") or None,
    )
    return shape, []


def read_hf_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(parsed config.json, "") or (None, why it cannot be read)."""
    if not path.is_dir():
        return None, f"{str(path)!r} is not a directory (cwd {Path.cwd()}); point it at a local HF checkpoint"
    if not (path / "config.json").is_file():
        return None, f"{str(path)!r} has no config.json; not a HF checkpoint"
    try:
        return json.loads((path / "config.json").read_text()), ""
    except json.JSONDecodeError as exc:
        return None, f"{path / 'config.json'} is not valid JSON: {exc}"


def parallel_fit(sizes: Mapping[str, int], num_layers: int, tp: int, pp: int) -> tuple[str | None, str | None]:
    """Why ``tp`` / ``pp`` cannot shard a model, as ``(tp_problem, pp_problem)``; None where they fit.

    megatron shards attention heads, KV heads (query groups) and the FFN across TP, and the
    layers across PP. ``sizes`` maps HF field names to the sizes TP must divide.
    """
    tp_problem = pp_problem = None
    bad = [f"{name} ({n})" for name, n in sizes.items() if n % tp]
    if bad:
        valid = [d for d in range(1, max(sizes.values()) + 1) if all(n % d == 0 for n in sizes.values())]
        tp_problem = f"{tp} does not divide {', '.join(bad)}; valid tp: {valid}"
    if num_layers % pp:
        valid = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        pp_problem = f"{pp} does not divide num_hidden_layers ({num_layers}); valid pp: {valid}"
    return tp_problem, pp_problem


def check_model_parallel(cfg: Config, shape: ModelShape) -> Found:
    """megatron shards heads, query groups and the FFN across TP, and layers across PP."""
    sizes = {"num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads}
    if shape.ffn_hidden is not None:
        sizes["intermediate_size"] = shape.ffn_hidden
    tp_problem, pp_problem = parallel_fit(sizes, shape.num_layers, cfg.parallel.tp, cfg.parallel.pp)
    if tp_problem:
        yield "parallel.tp", f"{tp_problem} (from {shape.source})"
    if pp_problem:
        yield "parallel.pp", f"{pp_problem} (from {shape.source})"
    ep = cfg.parallel.ep
    if ep > 1 and shape.num_experts is None:
        yield "parallel.ep", f"{ep} needs a mixture-of-experts model; {shape.source} is dense: use 1"
    elif shape.num_experts is not None and shape.num_experts % ep:
        yield "parallel.ep", f"{ep} does not divide num_experts ({shape.num_experts}, from {shape.source})"
