"""Each config section's own validation: every field (`fields.check_value`), then the rules
between fields of that one section (clip high vs low, devices vs engines, the staleness of a
pipeline mode, the SAGC candidates, ...).

Contract: `check_section(obj, key)` yields ``(key, message)`` for the section at dotted `key`
(``""`` = the whole `Config`) and every section under it; `obj` is the schema's dataclass or a
component settings class extending it (``EngineSettings`` is ``rollout``). The rules run only
when every field passed (`check_fields`, then `check_rules`). `require_valid(obj, key)` raises them as one `ConfigError`
(a ``ValueError``). The rule functions below are also called directly by components that hold
the same values under other names (``LossSettings``, ``VersionSchedule``, ``SAGCSettings``).
Rules across sections are `validate.py`'s.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, get_args

from .convert import field_types
from .devices import parse_device
from .distill_rules import distill_section
from .errors import suggest
from .fields import Found, check_value, raise_found, schema_type
from .model_shape import check_megatron_passthrough
from .schema import BuiltinController, BuiltinEnvironment, BuiltinGenerator, Config
from .schema_lora import LORA_TARGETS

DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")  # "pkg.mod:Name"
BUILTIN_CONTROLLERS: tuple[str, ...] = get_args(BuiltinController)
BUILTIN_ENVIRONMENTS: tuple[str, ...] = get_args(BuiltinEnvironment)
BUILTIN_GENERATORS: tuple[str, ...] = get_args(BuiltinGenerator)


def check_section(obj: Any, key: str = "") -> Found:
    """Every field of the section at `key` and of its sub-sections, then the rules of each
    section whose fields passed."""
    fields_found = list(check_fields(obj, key))
    yield from fields_found or check_rules(obj, key)


def check_fields(obj: Any, key: str = "") -> Found:
    """`fields.check_value` on every field of the section at `key` and of its sub-sections."""
    for name, tp in field_types(schema_type(key) if key else Config).items():
        sub = f"{key}.{name}" if key else name
        value = getattr(obj, name)
        if dataclasses.is_dataclass(tp) and dataclasses.is_dataclass(value):
            yield from check_fields(value, sub)
        else:
            yield from check_value(sub, value)


def check_rules(obj: Any, key: str = "") -> Found:
    """The rules within each section at or under `key` (its fields assumed valid)."""
    for name, tp in field_types(schema_type(key) if key else Config).items():
        if dataclasses.is_dataclass(tp):
            yield from check_rules(getattr(obj, name), f"{key}.{name}" if key else name)
    rule = SECTION_RULES.get(key)
    if rule is not None:
        yield from rule(obj)


def require_valid(obj: Any, key: str) -> None:
    """Raise one `ConfigError` listing the problems `check_section(obj, key)` finds."""
    raise_found(check_section(obj, key))


def clip_rule(low: float, high: float) -> Found:
    """Clip range [1 - low, 1 + high]: high >= low (DAPO's clip-higher: high > low)."""
    if not high >= low:
        yield "algorithm.clip.high", f"must be >= algorithm.clip.low ({low}), got {high!r}"


def decoupled_correction_rule(loss: str, mode: str) -> Found:
    """ppo_decoupled takes no second (truncated) importance weight."""
    if mode.endswith("_truncate") and loss == "ppo_decoupled":
        yield (
            "algorithm.rollout_correction.mode",
            f"{mode!r} with algorithm.loss 'ppo_decoupled' would weight twice (the behaviour weight "
            "π_prox/π_behav is the importance weight); use 'token_mask', 'sequence_mask' or 'none', and "
            "algorithm.behav_weight_cap to bound the behaviour weight",
        )


def staleness_rule(mode: str, max_staleness: int) -> Found:
    """stale mode lets samples lag max_staleness >= 1 versions; sync and periodic are on-policy (0)."""
    if mode == "stale" and max_staleness < 1:
        need = "max_staleness >= 1 (the policy versions a sample may lag)"
        yield "pipeline.max_staleness", f"pipeline.mode 'stale' needs {need}, got {max_staleness}"
    elif mode != "stale" and max_staleness > 0:
        fix = "set it to 0 or use pipeline.mode 'stale'"
        yield "pipeline.max_staleness", f"{max_staleness} > 0 needs pipeline.mode 'stale', got {mode!r}; {fix}"


def candidates_rule(candidates: Sequence[int]) -> Found:
    """SAGC candidates: a non-empty, strictly increasing list of positive group sizes."""
    if not candidates or candidates[0] < 1 or any(a >= b for a, b in itertools.pairwise(candidates)):
        yield "control.sagc.candidates", f"must be a non-empty, strictly increasing list, got {list(candidates)}"


def group_size_rule(kind: str, group_size: int, candidates: Sequence[int]) -> Found:
    """sagc starts at control.group_size, so it must be a candidate."""
    if kind == "sagc" and group_size not in candidates:
        yield "control.group_size", f"{group_size} must be one of control.sagc.candidates {list(candidates)}"


def _algorithm(a: Any) -> Found:
    yield from decoupled_correction_rule(a.loss, a.rollout_correction.mode)


def _clip(c: Any) -> Found:
    yield from clip_rule(c.low, c.high)


def _rollout_correction(rc: Any) -> Found:
    """c_min < c_max; truncation needs a bound."""
    key = "algorithm.rollout_correction"
    if rc.c_min is not None and rc.c_max is not None and not rc.c_min < rc.c_max:
        yield f"{key}.c_min", f"must be < {key}.c_max ({rc.c_max}), got {rc.c_min!r}"
    if rc.mode.endswith("_truncate") and rc.c_min is None and rc.c_max is None:
        yield f"{key}.mode", f"{rc.mode!r} needs c_min or c_max; set one, or use mode 'none'"


def _pipeline(p: Any) -> Found:
    yield from staleness_rule(p.mode, p.max_staleness)


def _rollout(r: Any) -> Found:
    """Engines vs devices vs TP, the vllm pass-through, the sync address."""
    yield from _engine_devices(r)
    yield from _engine_nodes(r)
    if r.vllm and r.engine != "vllm":
        yield "rollout.vllm", f"is only for rollout.engine 'vllm', got {r.engine!r}; remove it or use 'vllm'"
    yield from _sync_address(r.sync_address)
    yield from generator_rule(r.generator)


def generator_rule(name: str) -> Found:
    """rollout.generator is a builtin name or a dotted path (whether it imports: `resources.py`)."""
    if name not in BUILTIN_GENERATORS and not DOTTED_PATH.match(name):
        names, hint = ", ".join(BUILTIN_GENERATORS), suggest(name, BUILTIN_GENERATORS)
        yield "rollout.generator", f"{name!r} is not one of {names} or a dotted path 'pkg.mod:factory' ({hint})"


def _engine_devices(r: Any) -> Found:
    """One device string per engine (``["cuda:0,1", "cuda:2,3"]`` for 2 engines at TP 2), each
    naming one device per engine TP rank; CPU engines (and the hf engine) run TP 1."""
    if r.engine == "hf" and r.tensor_parallel_size != 1:
        yield "rollout.tensor_parallel_size", f"{r.tensor_parallel_size}, but the hf engine runs one device: use 1"
        return
    if r.devices and len(r.devices) != r.num_engines:
        yield (
            "rollout.devices",
            (
                f"lists {len(r.devices)} entries but rollout.num_engines = {r.num_engines}; give one "
                "device string per engine, e.g. 'cuda:0,1' for an engine at tensor_parallel_size 2"
            ),
        )
        return
    for i, text in enumerate(r.devices or ["cpu"]):  # no devices: unpinned CPU engines
        try:
            device = parse_device(text, f"rollout.devices[{i}]")
        except ValueError as err:
            yield "rollout.devices", str(err)
            continue
        if device.kind == "cpu" and r.tensor_parallel_size != 1:
            yield "rollout.tensor_parallel_size", f"{r.tensor_parallel_size} with CPU engine {text!r}: use 1 on CPU"
        elif device.kind != "cpu" and len(device.ids) != r.tensor_parallel_size:
            yield (
                "rollout.devices",
                (
                    f"[{i}] = {text!r} names {len(device.ids)} devices but "
                    f"rollout.tensor_parallel_size = {r.tensor_parallel_size}"
                ),
            )


def launch_nodes() -> int | None:
    """Nodes of the launch: ``NNODES`` (the launchers export it) or torchrun's ``GROUP_WORLD_SIZE``."""
    text = os.environ.get("NNODES") or os.environ.get("GROUP_WORLD_SIZE")
    return int(text) if text and text.isdigit() else None


def _engine_nodes(r: Any) -> Found:
    """One node rank per engine, each below the launch's node count; engines off node 0 get
    their weights over the network (node 0's /dev/shm is not theirs)."""
    if not r.engine_nodes:
        return
    if len(r.engine_nodes) != r.num_engines:
        yield (
            "rollout.engine_nodes",
            (
                f"lists {len(r.engine_nodes)} entries but rollout.num_engines = "
                f"{r.num_engines}; give the node rank of every engine, or [] (all on node 0)"
            ),
        )
        return
    nodes = launch_nodes()
    bad = [n for n in r.engine_nodes if n < 0 or (nodes is not None and n >= nodes)]
    if bad:
        yield (
            "rollout.engine_nodes",
            (
                f"{list(r.engine_nodes)} names node(s) {bad}, but the launch has "
                f"{nodes} node(s) (NNODES): use node ranks 0..{(nodes or 1) - 1}"
            ),
        )
    remote = sorted({n for n in r.engine_nodes if n != 0})
    if remote and r.weight_sync == "shared_memory":
        yield (
            "rollout.weight_sync",
            (
                f"'shared_memory' maps node 0's /dev/shm, but engines run on node(s) {remote} "
                "(rollout.engine_nodes): use 'broadcast' (or 'snapshot' on a shared filesystem)"
            ),
        )


def _sync_address(text: str) -> Found:
    """The weight-sync listeners bind to one IP address of this machine, never all interfaces."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        yield "rollout.sync_address", f"{text!r} is not an IP address; use e.g. 127.0.0.1 (loopback, one node)"
        return
    if address.is_unspecified:
        yield "rollout.sync_address", f"{text!r} would listen on every interface; give one address, e.g. 127.0.0.1"


def controller_rule(kind: str, options: Mapping[str, Any]) -> Found:
    """control.kind is a builtin name or a dotted path; only a dotted-path class takes options."""
    builtin = kind in BUILTIN_CONTROLLERS
    if not builtin and not DOTTED_PATH.match(kind):
        names = ", ".join(BUILTIN_CONTROLLERS)
        hint = suggest(kind, BUILTIN_CONTROLLERS)
        yield "control.kind", f"{kind!r} is not one of {names} or a dotted path 'pkg.mod:Class' ({hint})"
    if builtin and options:
        yield "control.options", f"are only for a dotted-path control.kind, not {kind!r}; remove them"


def _control(c: Any) -> Found:
    """Controller name and options; the starting G; every group size >= 2."""
    yield from controller_rule(c.kind, c.options)
    yield from group_size_rule(c.kind, c.group_size, c.sagc.candidates)
    sizes = {"control.group_size": [c.group_size]}
    if c.kind == "sagc":
        sizes["control.sagc.candidates"] = c.sagc.candidates
    for key, values in sizes.items():
        if min(values, default=2) < 2:  # A_i = r_i - group mean is 0 for a group of one
            yield key, f"group size {min(values)} < 2 makes every advantage 0; use group sizes >= 2"


def _sagc(s: Any) -> Found:
    yield from candidates_rule(s.candidates)


def _data(d: Any) -> Found:
    yield from data_source_rule(d.source, d.options)


def data_source_rule(src: str, options: Mapping[str, Any]) -> Found:
    """Forms of data.source and data.options (the file itself: `resources.py`)."""
    if not (re.fullmatch(r"reasoning_gym:\w+", src) or src.endswith((".jsonl", ".parquet"))):
        yield "data.source", f"{src!r} is neither 'reasoning_gym:<dataset>' nor a .jsonl / .parquet path"
    if options and not src.startswith("reasoning_gym:"):
        yield "data.options", f"are keyword arguments of a reasoning_gym dataset; {src!r} takes none"


def _reward(r: Any) -> Found:
    """Form of reward.fn (whether it imports: `resources.py`); reward.kind / weights and the judge and
    reward model they use (`reward_rules.py`)."""
    fn = r.fn
    if not fn or (":" in fn and not DOTTED_PATH.match(fn)) or (":" not in fn and not fn.isidentifier()):
        yield "reward.fn", f"{fn!r} is neither a builtin reward name nor a dotted path 'pkg.mod:function'"
    from .reward_rules import model_reward_rule  # it imports this module's DOTTED_PATH

    yield from model_reward_rule(r)


def _environment(e: Any) -> Found:
    """environment.kind is "none", a builtin name or a dotted path; options need an environment
    (whether the path imports and makes an Environment: `resources.py`)."""
    if e.kind not in BUILTIN_ENVIRONMENTS and not DOTTED_PATH.match(e.kind):
        names, hint = ", ".join(BUILTIN_ENVIRONMENTS), suggest(e.kind, BUILTIN_ENVIRONMENTS)
        yield "environment.kind", f"{e.kind!r} is not one of {names} or a dotted path 'pkg.mod:Factory' ({hint})"
    if e.kind == "none" and e.options:
        yield "environment.options", "are keyword arguments of an environment; environment.kind 'none' takes none"


def _agent(a: Any) -> Found:
    """agent.run is a dotted path (when set); counts and limits positive; off loopback a key."""
    if a.run and not DOTTED_PATH.match(a.run):
        yield "agent.run", f"{a.run!r} is not a dotted path 'pkg.mod:function' (a function run(task, base_url))"
    for name in ("workers", "timeout_s", "max_total_tokens"):
        if not getattr(a, name) > 0:
            yield f"agent.{name}", f"must be > 0, got {getattr(a, name)!r}"
    if not 0 <= a.port <= 65535:
        yield "agent.port", f"must be in [0, 65535] (0: a free port), got {a.port}"
    if a.host not in ("127.0.0.1", "localhost", "::1") and not a.key:
        yield "agent.key", f"agent.host={a.host!r} is not loopback: set agent.key (every request must carry it)"


# HF projection names -> the megatron linear that fuses them (a LoRA target names the latter)
HF_PROJECTIONS = {
    **dict.fromkeys(("q_proj", "k_proj", "v_proj"), "linear_qkv"),
    "o_proj": "linear_proj",
    **dict.fromkeys(("gate_proj", "up_proj"), "linear_fc1"),
    "down_proj": "linear_fc2",
}


def _lora(lo: Any) -> Found:
    """lora.target_modules: distinct megatron linear names among LORA_TARGETS, at least one."""
    if not lo.target_modules:
        yield "lora.target_modules", f"is empty: name at least one of {', '.join(LORA_TARGETS)}"
    for name in lo.target_modules:
        if name not in LORA_TARGETS:
            hf = HF_PROJECTIONS.get(name)
            hint = f"use {hf!r} (the megatron linear that holds HF's {name})" if hf else suggest(name, LORA_TARGETS)
            yield "lora.target_modules", f"{name!r} is not a megatron linear LoRA adapts; {hint}"
    if len(set(lo.target_modules)) != len(lo.target_modules):
        yield "lora.target_modules", f"names a module twice: {lo.target_modules}"


def _trainer(t: Any) -> Found:
    """Each optimizer step takes prompts_per_batch / mini_batches prompts; saving needs a place."""
    if t.prompts_per_batch % t.mini_batches:
        ppb = f"trainer.prompts_per_batch ({t.prompts_per_batch})"
        yield "trainer.mini_batches", f"{t.mini_batches} does not divide {ppb}"
    if t.save_every > 0 and t.save_dir is None:
        yield "trainer.save_every", f"{t.save_every} > 0 needs trainer.save_dir"
    if t.resume_from == "auto" and t.save_dir is None:
        yield "trainer.resume_from", "'auto' (continue from the last complete checkpoint) needs trainer.save_dir"


def _model(m: Any) -> Found:
    yield from check_megatron_passthrough(m.megatron)


SECTION_RULES: dict[str, Callable[[Any], Found]] = {
    "model": _model,
    "algorithm": _algorithm,
    "algorithm.clip": _clip,
    "algorithm.rollout_correction": _rollout_correction,
    "rollout": _rollout,
    "pipeline": _pipeline,
    "control": _control,
    "control.sagc": _sagc,
    "data": _data,
    "reward": _reward,
    "environment": _environment,
    "distill": distill_section,
    "agent": _agent,
    "lora": _lora,
    "trainer": _trainer,
}
