"""The engines of the models beside the policy: a distillation teacher (``distill``), an LLM judge
(``reward.judge``) and a reward model (``reward.model``): where they run and their memory per device.

Contract (``plan``'s section "model engines"):

- One ``ModelEngine`` per teacher engine (``distill.devices``, or ``distill.num_engines``
  unpinned CPU engines), per judge engine (``reward.judge.devices``, or one CPU engine) and per
  reward-model worker (``reward.model.devices``), when the run uses that model. They run on
  node 0 (global rank 0 starts them), on the accelerator ids their device string names; those
  ids are taken from node 0's training devices like the rollout engines' (``layout.py``).
- Memory per device: weights = the checkpoint's parameters (its ``config.json``: embedding,
  layers, final norm, and the LM head unless tied; a reward model has a one-logit score head
  instead) × dtype bytes / TP, plus the KV cache of one full batch: batch × tokens ×
  2 (K and V) × layers × ceil(kv_heads / TP) × head_dim × dtype bytes. Batch and tokens per
  sequence: the teacher ``distill.max_batch_size`` × (data.max_prompt_tokens +
  rollout.sampling.max_new_tokens); the judge ``reward.judge.batch`` × (the same + the
  template's and rubric's characters, each at most one token, + reward.judge.max_new_tokens);
  the reward model ``reward.model.batch`` × the teacher's tokens. A vLLM engine reserves what
  its own settings say on top (gpu_memory_utilization): this is what it needs.
- ``placement_problems(cfg, devices_per_node)``: an id named twice (by two engines of any
  kind, rollout included), or not among the top ids of node 0 the engines take; ``fit_problems(engines, device)``: an
  accelerator whose engines need more than the device's usable memory. Each names its key.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from megatron_rl.config.devices import parse_device
from megatron_rl.config.schema import Config
from megatron_rl.models.hf_config import decoder_spec_from_hf, read_hf_config
from megatron_rl.plan.devices import DeviceSpec
from megatron_rl.plan.memory import ModelDims, layer_params
from megatron_rl.plan.moe_memory import sparse_layers_of_stage, sparse_mlp_params

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class EngineUse:
    """One model's engines as the config asks for them (before sizing)."""

    role: str  # teacher | judge | reward model
    key: str  # the config key placing them
    path: str  # the checkpoint
    devices: tuple[str, ...]  # one device string per engine ("cpu" when unpinned)
    dtype: str
    tp: int
    batch: int
    tokens: int  # per sequence
    head: str  # "lm" or "score" (a one-logit classification head)


@dataclass(frozen=True, kw_only=True)
class ModelEngine:
    """One engine of a teacher / judge / reward model: its device and its memory per device."""

    role: str
    key: str
    index: int  # its index in ``key``'s list
    device: str
    kind: str  # cpu | cuda | npu
    ids: tuple[int, ...]  # accelerator ids on node 0 (none for a CPU engine)
    params: int  # the whole model's
    weights_bytes: int  # per device
    kv_bytes: int  # per device: the KV cache of batch × tokens
    batch: int
    tokens: int

    @property
    def total_bytes(self) -> int:
        """Weights and KV cache on each of its devices."""
        return self.weights_bytes + self.kv_bytes


def model_params(dims: ModelDims, *, head: str) -> int:
    """Parameters of the whole model: embedding, layers (MoE blocks included), final norm, head."""
    sparse = sparse_layers_of_stage(dims.moe, dims.layers, 1, 0)
    n = (dims.layers - sparse) * layer_params(dims, 1) + sparse * layer_params(dims, 1, sparse=True)
    if sparse:
        block, experts = sparse_mlp_params(dims.moe, dims.hidden, 1, 1)
        n += sparse * (block + experts)
    n += dims.vocab * dims.hidden + dims.hidden  # embedding, final norm
    if head == "score":
        return n + dims.hidden
    return n + (0 if dims.tied_embeddings else dims.vocab * dims.hidden)


def engine_uses(cfg: Config) -> list[EngineUse]:
    """The teacher, judge and reward model engines ``cfg`` runs (see the module doc)."""
    from megatron_rl.config.reward_rules import used_components

    tokens = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    uses, d, r = [], cfg.distill, cfg.reward
    if d.teacher:
        devices = tuple(d.devices) or ("cpu",) * d.num_engines
        dtype = d.dtype or cfg.model.dtype
        uses.append(EngineUse(role="teacher", key="distill.devices", path=d.teacher, devices=devices, dtype=dtype,
                              tp=d.tensor_parallel_size, batch=d.max_batch_size, tokens=tokens, head="lm"))  # fmt: skip
    used = used_components(r)
    if "judge" in used and r.judge.model:
        j = r.judge
        devices = tuple(j.devices) or ("cpu",)
        first = parse_device(devices[0], "reward.judge.devices")
        judged = tokens + len(j.template) + len(j.rubric) + j.max_new_tokens
        uses.append(EngineUse(role="judge", key="reward.judge.devices", path=j.model, devices=devices, dtype=j.dtype,
                              tp=1 if first.kind == "cpu" else len(first.ids), batch=j.batch, tokens=judged,
                              head="lm"))  # fmt: skip
    if "model" in used and r.model.path:
        m = r.model
        uses.append(EngineUse(role="reward model", key="reward.model.devices", path=m.path, devices=tuple(m.devices),
                              dtype=m.dtype, tp=1, batch=m.batch, tokens=tokens, head="score"))  # fmt: skip
    return uses


def model_engines(cfg: Config) -> list[ModelEngine]:
    """Every teacher / judge / reward-model engine of ``cfg``, sized (reads each checkpoint's config.json)."""
    return [engine for use in engine_uses(cfg) for engine in _sized(use)]


def _sized(use: EngineUse) -> Iterator[ModelEngine]:
    hf = read_hf_config(use.path)
    dims = ModelDims.from_spec(decoder_spec_from_hf(hf.get("text_config", hf)))
    width = DTYPE_BYTES[use.dtype]
    params = model_params(dims, head=use.head)
    kv = use.batch * use.tokens * 2 * dims.layers * math.ceil(dims.kv_heads / use.tp) * dims.head_dim * width
    for i, text in enumerate(use.devices):
        device = parse_device(text, f"{use.key}[{i}]")
        yield ModelEngine(
            role=use.role,
            key=use.key,
            index=i,
            device=text,
            kind=device.kind,
            ids=() if device.kind == "cpu" else tuple(device.ids),
            params=params,
            weights_bytes=math.ceil(params * width / use.tp),
            kv_bytes=kv,
            batch=use.batch,
            tokens=use.tokens,
        )


def model_engine_ids(cfg: Config) -> list[int]:
    """Accelerator ids the teacher / judge / reward-model engines take on node 0."""
    return [i for use in engine_uses(cfg) for text in use.devices for i in _accelerator_ids(text)]


def _accelerator_ids(text: str) -> tuple[int, ...]:
    device = parse_device(text)
    return () if device.kind == "cpu" else tuple(device.ids)


def placement_problems(cfg: Config, devices_per_node: int) -> list[str]:
    """Node 0 ids named by two engines (rollout's or a model's) or absent from the node, naming the key."""
    owner: dict[int, str] = {}
    for i, text in enumerate(cfg.rollout.devices):
        node = cfg.rollout.engine_nodes[i] if cfg.rollout.engine_nodes else 0
        owner.update({d: f"rollout.devices[{i}]" for d in (_accelerator_ids(text) if node == 0 else ())})
    problems, uses = [], engine_uses(cfg)
    training = devices_per_node - len(owner) - sum(len(_accelerator_ids(t)) for u in uses for t in u.devices)
    if training < 1 and any(_accelerator_ids(t) for u in uses for t in u.devices):
        return [f"{uses[0].key}: the engines take all {devices_per_node} devices of node 0; leave some for training"]
    for use in uses:
        for i, text in enumerate(use.devices):
            for d in _accelerator_ids(text):
                here = f"{use.key}[{i}]"
                if d in owner:
                    problems.append(f"{use.key}: device {d} of node 0 is also {owner[d]}; the {use.role} needs its own")
                elif not training <= d < devices_per_node:
                    problems.append(
                        f"{use.key}: {here} names device {d}; node 0's training ranks use ids 0..{training - 1} "
                        f"(local rank = device) of {devices_per_node}, so engines take ids {training}.."
                        f"{devices_per_node - 1}"
                    )
                owner.setdefault(d, here)
    return problems


def fit_problems(engines: list[ModelEngine], device: DeviceSpec) -> list[str]:
    """Accelerators whose model engines need more than ``device``'s usable memory, naming the key."""
    need: dict[int, list[ModelEngine]] = {}
    for engine in engines:
        for i in engine.ids:
            need.setdefault(i, []).append(engine)
    return [
        f"{on[0].key}: device {i} needs {sum(e.total_bytes for e in on) / GIB:.2f} GiB for the {on[0].role} "
        f"(weights + KV cache), over the {device.usable_bytes / GIB:.2f} GiB usable of a {device.name}; "
        "spread it over more devices (TP) or lower its batch"
        for i, on in sorted(need.items())
        if sum(e.total_bytes for e in on) > device.usable_bytes
    ]


def engine_lines(engines: list[ModelEngine]) -> list[str]:
    """``plan``'s text for the model engines (nothing when the run has none)."""
    if not engines:
        return []
    lines = ["model engines (node 0; weights + KV cache of one full batch, per device):"]
    for e in engines:
        where = f"devices {','.join(map(str, e.ids))}" if e.ids else f"{e.device} (host memory, not checked)"
        lines.append(
            f"  {e.role} {e.index} ({e.key}): {where}: {e.params / 1e9:.2f} B params, weights "
            f"{e.weights_bytes / GIB:.2f} GiB + KV {e.kv_bytes / GIB:.2f} GiB ({e.batch} seq x {e.tokens} tokens) "
            f"= {e.total_bytes / GIB:.2f} GiB"
        )
    return lines


def engines_json(engines: list[ModelEngine]) -> list[dict]:
    """The model engines as JSON-ready dicts (``plan --json``)."""
    return [{**asdict(e), "ids": list(e.ids), "total_bytes": e.total_bytes} for e in engines]
