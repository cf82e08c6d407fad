"""Checks a typed `Config` before anything launches: value ranges and cross-field rules.

Contract: `validate(cfg)` runs every named check below and raises one `ConfigError` listing
all problems, each naming the key(s), the value(s) and the fix. Range checks run first; the
cross-field rules assume sane ranges and run only when those pass. The model-shape rule
reads ``<model.hf_path>/config.json`` (that file only; `hf_config` may stand in for it).
`validate_world(cfg, world_size)` is the launch-time rule TP × PP (× DP) vs the world size.
Runtime capabilities (e.g. torch_npu for ``attention.backend: npu``) are checked by
`platform/`, not here.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import itertools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import ConfigError, Origins, Problem, suggest
from .schema import Config

Found = Iterator[tuple[str, str]]  # (dotted key, message) pairs yielded by a check

DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")  # "pkg.mod:Name"
BUILTIN_CONTROLLERS = ("fixed", "sagc")
# Dotted keys with a one-field bound (RANGES below); None values of optional fields are skipped.
# fmt: off
POSITIVE = (
    "model.make_vocab_size_divisible_by", "parallel.tp", "parallel.pp", "parallel.dp",
    "rollout.num_engines", "rollout.tensor_parallel_size", "rollout.sampling.max_new_tokens",
    "rollout.sampling.temperature", "pipeline.queue_size", "pipeline.micro_batch_tokens",
    "control.group_size", "data.size", "data.max_prompt_tokens", "trainer.steps",
    "trainer.prompts_per_batch", "trainer.mini_batches", "trainer.lr", "trainer.max_nonfinite_steps",
    "algorithm.advantage.eps",
    "algorithm.temperature", "algorithm.behav_weight_cap", "control.sagc.eta",
    "control.sagc.lambda_max", "control.sagc.prior_alpha", "control.sagc.prior_beta",
    "rollout.request_timeout_s", "rollout.start_timeout_s", "reward.timeout_s", "rollout.sync_bucket_mb",
    "trainer.logprob_chunk_tokens",
)
NON_NEGATIVE = (
    "pipeline.max_staleness", "trainer.save_every", "trainer.weight_decay", "trainer.grad_clip",
    "algorithm.overlong.buffer", "algorithm.overlong.penalty", "algorithm.kl.coef",
    "algorithm.entropy_coef", "rollout.max_restarts",
)
# TransformerConfig fields built from the HF config.json by models/.
HF_OWNED = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "kv_channels", "layernorm_epsilon", "normalization",
)
# fmt: on
# TransformerConfig fields this project sets itself; the value says from where.
MEGATRON_OWNED = {
    "tensor_model_parallel_size": "parallel.tp",
    "pipeline_model_parallel_size": "parallel.pp",
    "bf16": "model.dtype",
    "fp16": "model.dtype",
    "params_dtype": "model.dtype",
    **dict.fromkeys(HF_OWNED, "model.hf_path's config.json"),
}

MISMATCH_POSITIVE = ("algorithm.rollout_correction.c_min", "algorithm.rollout_correction.c_max")
MISMATCH_NON_NEGATIVE = (
    "algorithm.rollout_correction.delta", "algorithm.mismatch_alarm.logprob_abs_diff_mean",
    "algorithm.mismatch_alarm.logprob_abs_diff_max", "algorithm.mismatch_alarm.kl_k3",
    "algorithm.mismatch_alarm.seq_ratio_max", "algorithm.mismatch_alarm.masked_fraction",
)

RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(POSITIVE + MISMATCH_POSITIVE, (lambda v: v > 0, "must be > 0")),
    **dict.fromkeys(NON_NEGATIVE + MISMATCH_NON_NEGATIVE, (lambda v: v >= 0, "must be >= 0")),
    "rollout.sampling.top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "trainer.adam_beta1": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "trainer.adam_beta2": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "control.sagc.tau": (lambda v: v > 1, "must be > 1 (a ratio max/median response length)"),
    "control.sagc.delta": (lambda v: 0 < v < 1, "must be in (0, 1) (a target rate)"),
    "control.sagc.gamma": (lambda v: 0 < v <= 1, "must be in (0, 1] (a forgetting factor)"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of the HF model that parallelism must divide."""

    source: str  # where they were read, for messages: "<hf_path>/config.json"
    num_layers: int  # num_hidden_layers
    num_heads: int  # num_attention_heads
    num_kv_heads: int  # num_key_value_heads (megatron: num_query_groups)
    ffn_hidden: int | None  # intermediate_size, None when absent (e.g. MoE configs)


def validate(cfg: Config, *, hf_config: dict[str, Any] | None = None, origins: Origins | None = None) -> None:
    """Run every check on `cfg`; raise ConfigError listing all problems (placed by `origins`)."""
    found = list(check_ranges(cfg))
    if not found:
        for check in CROSS_FIELD_CHECKS:
            found += check(cfg)
        shape, shape_problems = model_shape(cfg, hf_config)
        found += shape_problems
        if shape is not None:
            found += check_model_parallel(cfg, shape)
    if found:
        origins = origins or Origins()
        raise ConfigError(Problem(key=k, message=m, where=origins.where(k)) for k, m in found)


def validate_world(cfg: Config, world_size: int, *, origins: Origins | None = None) -> int:
    """Check TP × PP (× DP if set) against the training world size; return the DP size."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tp, pp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp
    problem = None
    if world_size % (tp * pp):
        problem = Problem(
            key="parallel.tp",
            message=f"parallel.tp ({tp}) × parallel.pp ({pp}) = {tp * pp} does not divide world size "
            f"{world_size}; launch a multiple of {tp * pp} processes or change tp/pp",
        )
    elif dp is not None and tp * pp * dp != world_size:
        problem = Problem(
            key="parallel.dp",
            message=f"parallel.tp ({tp}) × parallel.pp ({pp}) × parallel.dp ({dp}) = {tp * pp * dp} ≠ world "
            f"size {world_size}; set parallel.dp to {world_size // (tp * pp)} or leave it unset",
        )
    if problem is not None:
        where = (origins or Origins()).where(problem.key)
        raise ConfigError([dataclasses.replace(problem, where=where)])
    return world_size // (tp * pp)


def _get(cfg: Config, key: str) -> Any:
    return functools.reduce(getattr, key.split("."), cfg)


def check_ranges(cfg: Config) -> Found:
    """Single-field bounds (positive sizes, probabilities in (0, 1], ...); None is allowed."""
    for key, (ok, requirement) in RANGES.items():
        value = _get(cfg, key)
        if value is not None and not ok(value):
            yield key, f"{requirement}, got {value!r}"


def check_staleness(cfg: Config) -> Found:
    """stale mode needs max_staleness >= 1 and the decoupled PPO loss; other modes need 0."""
    mode, d, loss = cfg.pipeline.mode, cfg.pipeline.max_staleness, cfg.algorithm.loss
    if mode == "stale":
        if d < 1:
            yield "pipeline.max_staleness", f"pipeline.mode 'stale' needs max_staleness >= 1, got {d}"
        if loss != "ppo_decoupled":
            why = "off-policy samples need the decoupled objective"
            yield (
                "algorithm.loss",
                f"pipeline.mode 'stale' needs algorithm.loss 'ppo_decoupled' ({why}), got {loss!r}",
            )
        ahead = (d + 1) * cfg.trainer.prompts_per_batch
        if d >= 1 and cfg.pipeline.queue_size < ahead:
            yield (
                "pipeline.queue_size",
                f"{cfg.pipeline.queue_size} cannot hold the {ahead} groups (max_staleness + 1) x prompts_per_batch "
                "the producer may run ahead by; a weight update would wait on a full queue",
            )
    elif d > 0:
        fix = "set it to 0 or use pipeline.mode 'stale'"
        yield "pipeline.max_staleness", f"{d} > 0 needs pipeline.mode 'stale', got {mode!r}; {fix}"


def check_clip(cfg: Config) -> Found:
    """Clip range [1 - low, 1 + high]: 0 < low < 1 and high >= low (DAPO: high > low)."""
    low, high = cfg.algorithm.clip.low, cfg.algorithm.clip.high
    if not 0 < low < 1:
        yield "algorithm.clip.low", f"must be in (0, 1), got {low!r}"
    elif not high >= low:
        yield "algorithm.clip.high", f"must be >= algorithm.clip.low ({low}), got {high!r}"


def check_rollout_correction(cfg: Config) -> Found:
    """c_min < c_max; truncation needs a bound; ppo_decoupled takes no second (truncated) weight."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    if rc.c_min is not None and rc.c_max is not None and not rc.c_min < rc.c_max:
        yield f"{key}.c_min", f"must be < {key}.c_max ({rc.c_max}), got {rc.c_min!r}"
    if rc.mode.endswith("_truncate") and rc.c_min is None and rc.c_max is None:
        yield f"{key}.mode", f"{rc.mode!r} needs c_min or c_max; set one, or use mode 'none'"
    if rc.mode.endswith("_truncate") and cfg.algorithm.loss == "ppo_decoupled":
        yield (
            f"{key}.mode",
            f"{rc.mode!r} with algorithm.loss 'ppo_decoupled' would weight twice (the behaviour weight "
            "π_prox/π_behav is the importance weight); use 'token_mask', 'sequence_mask' or 'none', and "
            "algorithm.behav_weight_cap to bound the behaviour weight",
        )


def check_overlong(cfg: Config) -> Found:
    """The overlong penalty ramp must fit inside the response length."""
    ov, max_new = cfg.algorithm.overlong, cfg.rollout.sampling.max_new_tokens
    if ov.enabled and not 0 < ov.buffer < max_new:
        need = f"0 < buffer < rollout.sampling.max_new_tokens ({max_new})"
        yield "algorithm.overlong.buffer", f"algorithm.overlong.enabled needs {need}, got {ov.buffer}"


def check_control(cfg: Config) -> Found:
    """Controller name and options; sagc candidates; every group size >= 2."""
    c = cfg.control
    builtin = c.kind in BUILTIN_CONTROLLERS
    if not builtin and not DOTTED_PATH.match(c.kind):
        hint = suggest(c.kind, BUILTIN_CONTROLLERS)
        yield "control.kind", f"{c.kind!r} is not fixed, sagc or a dotted path 'pkg.mod:Class' ({hint})"
    if builtin and c.options:
        yield "control.options", f"are only for a dotted-path control.kind, not {c.kind!r}; remove them"
    sizes = {"control.group_size": [c.group_size]}
    if c.kind == "sagc":
        cands = c.sagc.candidates
        if not cands or any(a >= b for a, b in itertools.pairwise(cands)):
            yield "control.sagc.candidates", f"must be a non-empty, strictly increasing list, got {cands}"
        elif c.group_size not in cands:
            yield "control.group_size", f"{c.group_size} must be one of control.sagc.candidates {cands}"
        sizes["control.sagc.candidates"] = cands
    for key, values in sizes.items():
        if min(values, default=2) < 2:  # A_i = r_i - group mean is 0 for a group of one
            yield key, f"group size {min(values)} < 2 makes every advantage 0; use group sizes >= 2"


def check_batch_split(cfg: Config) -> Found:
    """Each optimizer step takes prompts_per_batch / mini_batches prompts: it must divide."""
    t = cfg.trainer
    if t.prompts_per_batch % t.mini_batches:
        ppb = f"trainer.prompts_per_batch ({t.prompts_per_batch})"
        yield "trainer.mini_batches", f"{t.mini_batches} does not divide {ppb}"


def check_micro_batch_budget(cfg: Config) -> Found:
    """A micro-batch must hold a prompt and one response of the longest allowed lengths (a group
    over the budget is split into parts that share the prompt, but a part holds one response)."""
    p, need = cfg.pipeline, cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    if p.micro_batch_tokens < need:
        yield (
            "pipeline.micro_batch_tokens",
            f"{p.micro_batch_tokens} < data.max_prompt_tokens ({cfg.data.max_prompt_tokens}) + "
            f"rollout.sampling.max_new_tokens ({cfg.rollout.sampling.max_new_tokens}) = {need}; raise it to >= {need}",
        )


def check_streaming(cfg: Config) -> Found:
    """What the streaming pipeline and the one-replica loop cannot do (refused before launch)."""
    if cfg.algorithm.advantage.scale == "batch":
        yield (
            "algorithm.advantage.scale",
            "'batch' needs the whole batch before the first group can train, which defeats periodic "
            "asynchrony; use 'group' or 'none'",
        )


def check_temperature(cfg: Config) -> Found:
    """Log-probs must be computed at the temperature the responses were sampled at."""
    train_t, sample_t = cfg.algorithm.temperature, cfg.rollout.sampling.temperature
    if train_t != sample_t:
        fix = "log-probs must be computed at the sampling temperature: set both to the same value"
        yield (
            "algorithm.temperature",
            f"{train_t} differs from rollout.sampling.temperature ({sample_t}); {fix}",
        )


def check_checkpointing(cfg: Config) -> Found:
    """Periodic saving needs somewhere to save."""
    if cfg.trainer.save_every > 0 and cfg.trainer.save_dir is None:
        yield "trainer.save_every", f"{cfg.trainer.save_every} > 0 needs trainer.save_dir"


def check_rollout_devices(cfg: Config) -> Found:
    """One device string per engine, naming one device per engine TP rank (the format of
    ``rollout/settings.parse_device``): ``["cuda:0,1", "cuda:2,3"]`` for 2 engines at TP 2."""
    from megatron_rl.rollout.settings import parse_device

    r = cfg.rollout
    if r.engine == "hf" and r.tensor_parallel_size != 1:
        yield "rollout.tensor_parallel_size", f"{r.tensor_parallel_size}, but the hf engine runs one device: use 1"
    if r.devices and len(r.devices) != r.num_engines:
        yield "rollout.devices", (f"lists {len(r.devices)} entries but rollout.num_engines = {r.num_engines}; give one "
                                  "device string per engine, e.g. 'cuda:0,1' for an engine at tensor_parallel_size 2")
        return
    for i, text in enumerate(r.devices):
        try:
            device = parse_device(text, f"rollout.devices[{i}]")
        except ValueError as err:
            yield "rollout.devices", str(err)
            continue
        if device.kind == "cpu" and r.tensor_parallel_size != 1:
            yield "rollout.tensor_parallel_size", f"{r.tensor_parallel_size} with CPU engine {text!r}: use 1 on CPU"
        elif device.kind != "cpu" and len(device.ids) != r.tensor_parallel_size:
            yield "rollout.devices", (f"[{i}] = {text!r} names {len(device.ids)} devices but "
                                      f"rollout.tensor_parallel_size = {r.tensor_parallel_size}")


def check_sync_address(cfg: Config) -> Found:
    """The weight-sync listeners bind to one IP address of this machine, never all interfaces."""
    text = cfg.rollout.sync_address
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        yield "rollout.sync_address", f"{text!r} is not an IP address; use e.g. 127.0.0.1 (loopback, one node)"
        return
    if address.is_unspecified:
        yield "rollout.sync_address", f"{text!r} would listen on every interface; give one address, e.g. 127.0.0.1"


def check_sources(cfg: Config) -> Found:
    """Forms of data.source and reward.fn (existence is checked by data/ and rewards/)."""
    src = cfg.data.source
    if not (re.fullmatch(r"reasoning_gym:\w+", src) or src.endswith((".jsonl", ".parquet"))):
        yield "data.source", f"{src!r} is neither 'reasoning_gym:<dataset>' nor a .jsonl / .parquet path"
    if cfg.data.options and not src.startswith("reasoning_gym:"):
        yield "data.options", f"are keyword arguments of a reasoning_gym dataset; {src!r} takes none"
    fn = cfg.reward.fn
    if not fn or (":" in fn and not DOTTED_PATH.match(fn)) or (":" not in fn and not fn.isidentifier()):
        yield "reward.fn", f"{fn!r} is neither a builtin reward name nor a dotted path 'pkg.mod:function'"


def check_megatron_passthrough(cfg: Config) -> Found:
    """model.megatron names must be TransformerConfig fields this project does not set itself."""
    if not cfg.model.megatron:
        return
    known = megatron_field_names()
    for name in cfg.model.megatron:
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


CROSS_FIELD_CHECKS: tuple[Callable[[Config], Found], ...] = (
    check_staleness,
    check_clip,
    check_rollout_correction,
    check_overlong,
    check_control,
    check_batch_split,
    check_micro_batch_budget,
    check_streaming,
    check_temperature,
    check_checkpointing,
    check_rollout_devices,
    check_sync_address,
    check_sources,
    check_megatron_passthrough,
)


def model_shape(
    cfg: Config, hf_config: dict[str, Any] | None
) -> tuple[ModelShape | None, list[tuple[str, str]]]:
    """Read the sizes TP/PP must divide from `hf_config` or ``<model.hf_path>/config.json``."""
    source = f"{cfg.model.hf_path}/config.json"
    if hf_config is None:
        hf_config, why = _read_hf_json(Path(cfg.model.hf_path))
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
    )
    return shape, []


def _read_hf_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(parsed config.json, "") or (None, why it cannot be read)."""
    if not path.is_dir():
        return None, f"{str(path)!r} is not a directory (cwd {Path.cwd()}); point it at a local HF checkpoint"
    if not (path / "config.json").is_file():
        return None, f"{str(path)!r} has no config.json; not a HF checkpoint"
    try:
        return json.loads((path / "config.json").read_text()), ""
    except json.JSONDecodeError as exc:
        return None, f"{path / 'config.json'} is not valid JSON: {exc}"


def check_model_parallel(cfg: Config, shape: ModelShape) -> Found:
    """megatron shards heads, query groups and the FFN across TP, and layers across PP."""
    from megatron_rl.models.hf_config import parallel_fit

    sizes = {"num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads}
    if shape.ffn_hidden is not None:
        sizes["intermediate_size"] = shape.ffn_hidden
    tp_problem, pp_problem = parallel_fit(sizes, shape.num_layers, cfg.parallel.tp, cfg.parallel.pp)
    if tp_problem:
        yield "parallel.tp", f"{tp_problem} (from {shape.source})"
    if pp_problem:
        yield "parallel.pp", f"{pp_problem} (from {shape.source})"
