"""A launch plan from a validated `Config`: layout, tri-model residency, memory, verdict.

`build_plan(cfg, nodes=…, devices_per_node=…, device=…)` reads the architecture from
``<model.hf_path>/config.json``, places ranks and engines (`layout.py`), asks the tri-model
plan which copies run (`trimodel/plan.py`), sizes one training device (`memory.py`) and, when
the largest stage does not fit the device (`devices.py`), searches one knob at a time
(parallel.tp, parallel.pp, parallel.cp, parallel.ep, parallel.distributed_optimizer,
pipeline.micro_batch_tokens, model.megatron.recompute_granularity, and lora.rank when LoRA is
off) for values that would fit: the refusal names them (for parallel.cp the smallest size that
fits and that check-config accepts). With LoRA on, the plan also sizes the same run without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from megatron_rl.attention.backends import auto_backend
from megatron_rl.config.cp_rules import cp_sizes
from megatron_rl.config.schema import Config
from megatron_rl.models.hf_config import decoder_spec_from_hf, parallel_fit, read_hf_config
from megatron_rl.plan.devices import DeviceSpec, device_spec
from megatron_rl.plan.layout import ClusterLayout, plan_layout
from megatron_rl.plan.lora_memory import LoraMemory
from megatron_rl.plan.memory import (
    MemorySettings,
    MicroBatchShape,
    ModelDims,
    StageMemory,
    estimate_memory,
    with_changes,
)
from megatron_rl.trimodel.plan import TriModelPlan

LORA_RANKS = (64, 32, 16, 8)  # lora.rank values the refusal tries, largest first
BACKEND_KIND = {"npu": "npu", "triton": "cuda"}  # backends bound to one device kind


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything `python -m megatron_rl plan` prints, and its verdict."""

    layout: ClusterLayout
    device: DeviceSpec
    dims: ModelDims
    model_type: str
    settings: MemorySettings
    trimodel: TriModelPlan
    stages: tuple[StageMemory, ...]
    advice: tuple[str, ...]  # knob changes that would make a refused plan fit
    full_finetune: tuple[StageMemory, ...] = ()  # with lora.rank > 0: the same run without LoRA

    @property
    def worst(self) -> StageMemory:
        """The stage with the most memory per device (what must fit)."""
        return max(self.stages, key=lambda s: s.total)

    @property
    def sharers(self) -> int:
        """Training ranks that share one device's memory: all ranks of a node on the CPU, else 1."""
        return max(self.layout.ranks_per_node) if self.device.kind == "cpu" else 1

    @property
    def fits(self) -> bool:
        """The largest stage (times the ranks sharing the memory) is within the usable share."""
        return self.worst.total * self.sharers <= self.device.usable_bytes


def micro_batch_shape(cfg: Config, tokens: int | None = None) -> MicroBatchShape:
    """The largest micro-batch the config allows: `tokens` (default pipeline.micro_batch_tokens)
    filled with groups of the longest prompt and as many of the longest responses as fit (up
    to the largest group size)."""
    t = tokens or cfg.pipeline.micro_batch_tokens
    lp, lr = cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens
    g = max(cfg.control.sagc.candidates) if cfg.control.kind == "sagc" else cfg.control.group_size
    k = max(1, min(g, (t - lp) // lr))
    return MicroBatchShape(tokens=t, prompt_len=lp, response_len=lr, responses=k, parts=max(1, t // (lp + k * lr)))


def memory_settings(cfg: Config, layout: ClusterLayout, device: DeviceSpec, trimodel: TriModelPlan) -> MemorySettings:
    """The memory model's inputs for `cfg` on `layout`."""
    backend = cfg.attention.backend
    if backend == "auto":  # flex on CUDA under CP, as core_attention runs it (attention/context_parallel.py)
        backend = auto_backend(device.kind, triton=cfg.parallel.cp == 1)
    elif BACKEND_KIND.get(backend, device.kind) != device.kind:
        raise ValueError(
            f"attention.backend {backend!r} runs on {BACKEND_KIND[backend]} devices, not --device "
            f"{device.name}; use 'auto' or a backend of that device"
        )
    return MemorySettings(
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        dtype=cfg.model.dtype,
        copies=len(trimodel.active),
        distributed_optimizer=cfg.parallel.distributed_optimizer,
        attention_backend=backend,
        recompute=str(cfg.model.megatron.get("recompute_granularity") or "none"),
        micro_batch=micro_batch_shape(cfg),
        make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by,
        entropy=cfg.algorithm.entropy_coef > 0,
        logprob_chunk_tokens=cfg.trainer.logprob_chunk_tokens,
        ep=cfg.parallel.ep,
        lora=lora_memory(cfg, trimodel),
        cp=layout.cp,
    )


def lora_memory(cfg: Config, trimodel: TriModelPlan) -> LoraMemory | None:
    """The LoRA terms' inputs (None for lora.rank 0): the old policy, when it runs, is one more
    adapter snapshot; the reference is the base itself."""
    if cfg.lora.rank == 0:
        return None
    return LoraMemory(
        rank=cfg.lora.rank,
        targets=tuple(cfg.lora.target_modules),
        dropout=cfg.lora.dropout > 0,
        snapshots=1 + ("old" in trimodel.active),
    )


def build_plan(cfg: Config, *, nodes: int, devices_per_node: int, device: str | DeviceSpec) -> Plan:
    """The plan of `cfg` on `nodes` × `devices_per_node` devices of kind `device`."""
    from megatron_rl.trainer.from_config import trimodel_plan

    spec_dev = device if isinstance(device, DeviceSpec) else device_spec(device)
    hf = read_hf_config(cfg.model.hf_path)
    spec = decoder_spec_from_hf(hf.get("text_config", hf))
    dims = ModelDims.from_spec(spec)
    layout = plan_layout(cfg, nodes=nodes, devices_per_node=devices_per_node)
    trimodel = trimodel_plan(cfg)  # the trainer's own choice
    settings = memory_settings(cfg, layout, spec_dev, trimodel)
    stages = tuple(estimate_memory(dims, settings))
    plan = Plan(
        layout=layout,
        device=spec_dev,
        dims=dims,
        model_type=spec.model_type,
        settings=settings,
        trimodel=trimodel,
        stages=stages,
        advice=(),
        full_finetune=tuple(estimate_memory(dims, with_changes(settings, lora=None))) if settings.lora else (),
    )
    if plan.fits:
        return plan
    advice = _advice(cfg, dims, settings, spec_dev.usable_bytes // plan.sharers, layout.world_size)
    return Plan(**{**plan.__dict__, "advice": tuple(advice)})


def _peak(dims: ModelDims, settings: MemorySettings) -> int:
    return max(s.total for s in estimate_memory(dims, settings))


@dataclass(frozen=True)
class _Knob:
    """One config key to try alone: its candidate values in order, and the settings each gives."""

    key: str
    values: list
    change: Callable[[object], MemorySettings]
    note: str = ""


def _parallel_knobs(cfg: Config, dims: ModelDims, s: MemorySettings, world: int) -> list[_Knob]:
    """More tensor, pipeline, context or expert parallelism, or the distributed optimizer, on the same devices."""
    sizes = {"num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads, "intermediate_size": dims.ffn}
    tps = [
        t
        for t in range(s.tp + 1, dims.heads + 1)  # keeping parallel.ep dividing the new dp
        if world % (t * s.pp * s.cp * s.ep) == 0 and parallel_fit(sizes, 1, t, 1)[0] is None
    ]
    pps = [
        p for p in range(s.pp + 1, dims.layers + 1) if dims.layers % p == 0 and world % (s.tp * p * s.cp * s.ep) == 0
    ]
    knobs = [
        _Knob("parallel.tp", tps, lambda t: with_changes(s, tp=t, dp=world // (t * s.pp * s.cp))),
        _Knob("parallel.pp", pps, lambda p: with_changes(s, pp=p, dp=world // (s.tp * p * s.cp))),
        _Knob("parallel.cp", cp_sizes(cfg, world), lambda c: with_changes(s, cp=c, dp=world // (s.tp * s.pp * c))),
    ]
    if dims.moe is not None:  # more expert parallelism: fewer experts per rank (ep divides dp × cp and experts)
        dp_cp = s.dp * s.cp  # megatron's expert groups are carved out of the DP × CP ranks
        eps = [e for e in range(s.ep + 1, dp_cp + 1) if dp_cp % e == 0 and dims.moe.experts % e == 0]
        knobs.append(_Knob("parallel.ep", eps, lambda e: with_changes(s, ep=e)))
    if not s.distributed_optimizer and s.dp > 1:
        knobs.append(
            _Knob("parallel.distributed_optimizer", [True], lambda v: with_changes(s, distributed_optimizer=v))
        )
    return knobs


def _lora_knobs(cfg: Config, s: MemorySettings) -> list[_Knob]:
    """LoRA (largest rank first) when it is off: a frozen base without gradients, optimizer
    state or reference copy, only adapters trained."""
    from megatron_rl.trainer.from_config import trimodel_plan

    if s.lora is not None:
        return []
    trimodel = trimodel_plan(cfg)

    def change(rank: int) -> MemorySettings:
        return with_changes(s, lora=lora_memory(replace(cfg, lora=replace(cfg.lora, rank=rank)), trimodel))

    return [_Knob("lora.rank", list(LORA_RANKS), change, " (adapters only; the base frozen)")]


def _activation_knobs(cfg: Config, s: MemorySettings) -> list[_Knob]:
    """Smaller micro-batches (never below one prompt + response) or full recompute."""
    floor = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    budgets = sorted({max(floor, int(s.micro_batch.tokens * 0.75**i)) for i in range(1, 12)}, reverse=True)
    knobs = [
        _Knob(
            "pipeline.micro_batch_tokens",
            [b for b in budgets if b < s.micro_batch.tokens],
            lambda b: with_changes(s, micro_batch=micro_batch_shape(cfg, b)),
        )
    ]
    if s.recompute != "full":
        knobs.append(
            _Knob(
                "model.megatron.recompute_granularity",
                ["full"],
                lambda r: with_changes(s, recompute=r),
                " with model.megatron.recompute_method=uniform, model.megatron.recompute_num_layers=1",
            )
        )
    return knobs


def _advice(cfg: Config, dims: ModelDims, s: MemorySettings, usable: int, world: int) -> list[str]:
    """One line per knob that, changed alone, brings the largest stage under `usable` bytes."""
    out: list[str] = []
    for knob in _parallel_knobs(cfg, dims, s, world) + _activation_knobs(cfg, s) + _lora_knobs(cfg, s):
        for v in knob.values:
            if (peak := _peak(dims, knob.change(v))) <= usable:
                out.append(f"{knob.key}={v} fits ({peak / 2**30:.1f} GiB){knob.note}")
                break
    if not out:
        out.append(
            "no single knob suffices: raise parallel.tp / parallel.pp / parallel.cp (more devices per model), enable "
            "parallel.distributed_optimizer, lower pipeline.micro_batch_tokens, or use a larger --device"
        )
    return out
