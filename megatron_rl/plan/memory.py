"""Memory per training device of the tri-model, from the HF architecture and the config.

Contract: `estimate_memory(dims, settings)` returns, for every pipeline stage, the bytes one
training rank of that stage holds at the peak of a micro-step (`StageMemory`); the plan
reports the largest. Nothing here allocates a tensor: it is arithmetic over `ModelDims`
(read from ``config.json`` via `models/hf_config.decoder_spec_from_hf`) and `MemorySettings`
(derived from the config by `plan/build.py`). The terms, for one rank (TP size t, stage s):

- weights: the stage's parameters / t (norms are replicated) × dtype bytes, once per copy on
  the device during a micro-step: the policy, and old / ref when the tri-model plan
  (`trimodel/plan.py`) keeps them (an offloaded copy is on the device for each micro-step);
- grads: megatron DDP's gradient buffer, fp32 (``grad_reduce_in_fp32``): 4 B / parameter;
- optimizer: Adam's two fp32 moments (8 B / parameter) plus, for a bf16 model, the fp32
  master copy (4 B); the distributed optimizer divides this by DP;
- activations: what autograd saves for the backward of ONE micro-batch of T tokens
  (`PolicyTrainer.train_micro_batch` runs one micro-batch per schedule, so one is in flight
  per stage; the frozen copies run under no_grad and save nothing) — `layer_activation_bytes`
  per layer, recompute aware (``model.megatron.recompute_granularity``);
- log-prob buffers (last stage): the fp32 softmax of the N response rows that megatron's
  vocab-parallel cross entropy saves ([N, V/t] fp32). With ``trainer.logprob_chunk_tokens``
  (`trimodel/logprobs.py`: the head runs on the N scored positions only, c rows at a time,
  checkpointed when N > c) only the [N, h] head inputs stay, and one chunk is rebuilt in the
  backward;
- transient: the largest short-lived working set on top of the above: logits and their fp32
  copies while log-probs are reduced (measured: [rows, V/t] × (b + 4) bytes for one pass,
  × (b + 8) per checkpointed chunk), or a layer's backward working set (gradients of the
  SwiGLU intermediates, 3·T·f/t·b, and of the fp32 norm upcasts, 8·T·h) on top of what
  recompute rebuilds (a whole layer for ``full``, the core attention for ``selective``).

Per-layer saved bytes were read off megatron-core 0.16's local spec with a saved-tensors hook
(`tests/test_memory_plan.py` checks the sum against such a measurement within ±20 %). b =
bytes of model.dtype, h hidden, f FFN, nq / nkv heads, d head_dim:

    RMSNorm (×2)      T·h·(8 + b) + 4·T      fp32 upcast of x and x·rstd, rstd, bf16/fp32 output
    q/k RMSNorm       8·T·(nq+nkv)·d/t (+4·T·(nq+nkv)·d/t in fp32: k's input is a view of QKV)
    RoPE              4·T·d·b                cos / sin for q and k
    core attention    backend dependent (`attention_core_bytes`)
    out projection    T·nq·d/t·b             its input
    SwiGLU MLP        5·T·f/t·b              fc1 output (2f), silu output and gate (2f), fc2 input (f)

With LoRA (``lora.rank`` > 0, `plan/lora_memory.py`) the weights are the frozen base once (the
reference is the base with the adapters off) plus the adapters of the policy and, when it runs,
the old policy's snapshot; grads and optimizer count the adapters only; each layer's
activations add the adapters' low-rank inputs.

Mixture-of-experts layers (`plan/moe_memory.py`): the routed experts' parameters are divided by
EP × TP (the dense ones by TP, and PP by layers, as above), their gradients are reduced and
their distributed-optimizer state sharded over the expert-data-parallel group (dp / ep); the
MoE block's activations count the top-k routed copies of every token through the expert MLPs.

Context parallelism (``parallel.cp`` = c, `plan/cp_memory.py`, where the attention core's terms
live): T above is a rank's T / c tokens, plus each layer's all-gathered K / V of all T tokens
(saved without recompute) and their gradients in a layer's backward; the distributed optimizer
shards over DP × CP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_rl.models.hf_config import DecoderSpec, padded_vocab_size
from megatron_rl.plan.cp_memory import attention_core_bytes, kv_gather_bytes, kv_gather_kept, rank_tokens
from megatron_rl.plan.lora_memory import LoraMemory, layer_adapter_params
from megatron_rl.plan.lora_memory import layer_activation_bytes as lora_activation_bytes
from megatron_rl.plan.moe_memory import (
    MoeDims,
    sparse_layers_of_stage,
    sparse_mlp_activation_bytes,
    sparse_mlp_params,
    sparse_mlp_width,
)
from megatron_rl.trimodel.logprobs import head_is_chunked

RECOMPUTE = ("none", "selective", "full")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The architecture sizes the memory model needs (from a HF config.json)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # real vocabulary (padded by megatron: `padded_vocab`)
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    moe: MoeDims | None = None  # None: a dense decoder

    @classmethod
    def from_spec(cls, spec: DecoderSpec) -> ModelDims:
        """Dims of a `DecoderSpec` (``models.hf_config.decoder_spec_from_hf``)."""
        return cls(
            layers=spec.num_layers,
            hidden=spec.hidden_size,
            ffn=spec.ffn_hidden_size,
            heads=spec.num_attention_heads,
            kv_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            vocab=spec.vocab_size,
            qkv_bias=spec.qkv_bias,
            qk_norm=spec.qk_norm,
            tied_embeddings=spec.tie_word_embeddings,
            moe=MoeDims.from_spec(spec.moe) if spec.moe is not None else None,
        )


@dataclass(frozen=True, kw_only=True)
class MicroBatchShape:
    """One packed micro-batch: `parts` prompts of `prompt_len`, each with `responses` of
    `response_len` (shared-prompt layout), inside a budget of `tokens` packed tokens."""

    tokens: int  # T: packed tokens the activations are sized for
    prompt_len: int
    response_len: int
    responses: int  # responses sharing one prompt copy (K of a group part)
    parts: int  # group parts in the micro-batch

    @property
    def response_tokens(self) -> int:
        """N: rows of log-probs (every token of every response)."""
        return self.parts * self.responses * self.response_len


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """The config's memory-relevant choices, for one layout."""

    tp: int
    pp: int
    dp: int
    dtype: str  # model.dtype
    copies: int  # tri-model copies on the device during a micro-step (policy + active old / ref)
    distributed_optimizer: bool
    attention_backend: str  # concrete backend: npu | triton | flex | split | reference
    recompute: str = "none"  # model.megatron.recompute_granularity (none | selective | full)
    micro_batch: MicroBatchShape
    make_vocab_size_divisible_by: int = 128
    entropy: bool = False  # entropy bonus: its fp32 [N, V/t] terms are saved too
    # trainer.logprob_chunk_tokens: head rows scored at a time (checkpointed beyond one chunk);
    # None = the head runs on all T positions and the N rows are reduced at once
    logprob_chunk_tokens: int | None = None
    ep: int = 1  # parallel.ep: splits the routed experts (expert TP = tp, megatron's default)
    lora: LoraMemory | None = None  # lora.rank > 0: frozen base + trained adapters (`lora_memory`)
    cp: int = 1  # parallel.cp: ranks splitting every micro-batch's tokens (`cp_memory`)

    @property
    def expert_dp(self) -> int:
        """Size of the expert-data-parallel group (dp·cp·tp ranks hold ep·tp expert shards)."""
        return max(1, self.dp * self.cp // self.ep)

    @property
    def tokens(self) -> int:
        """Packed tokens one rank holds of a micro-batch (all of them at cp 1)."""
        return rank_tokens(self.micro_batch.tokens, self.cp)

    @property
    def response_rows(self) -> int:
        """Log-prob rows one rank scores: N, at most its tokens under CP."""
        return min(self.micro_batch.response_tokens, self.tokens)

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of model.dtype."""
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    """Bytes one training rank of pipeline stage `stage` holds at a micro-step's peak."""

    stage: int
    params: int  # parameters of one copy on this rank (routed experts included)
    weights: int
    grads: int
    optimizer: int
    activations: int
    logprobs: int
    transient: int
    expert_params: int = 0  # of `params`, the routed experts' (EP-sharded)
    adapter_params: int = 0  # LoRA adapters of one copy on this rank (not in `params`)
    kv_gather: int = 0  # of `activations`, the CP all-gathered K / V the stage's layers keep

    @property
    def total(self) -> int:
        """Everything the rank holds at the micro-step's peak."""
        return self.weights + self.grads + self.optimizer + self.activations + self.logprobs + self.transient


def stage_layers(dims: ModelDims, pp: int) -> int:
    """Layers per pipeline stage (megatron splits evenly; the validator checks pp divides)."""
    return dims.layers // pp


def layer_params(dims: ModelDims, tp: int, sparse: bool = False) -> int:
    """Parameters of one decoder layer on one TP rank (local spec: no linear biases but QKV's),
    without its MLP when `sparse` (the MoE block: `moe_memory.sparse_mlp_params`)."""
    h, d = dims.hidden, dims.head_dim
    qkv_out = (dims.heads + 2 * dims.kv_heads) * d
    mlp = 0 if sparse else 3 * h * dims.ffn
    sharded = h * qkv_out + dims.heads * d * h + mlp + (qkv_out if dims.qkv_bias else 0)
    replicated = 2 * h + (2 * d if dims.qk_norm else 0)
    return sharded // tp + replicated


def stage_params(dims: ModelDims, settings: MemorySettings, stage: int) -> tuple[int, int]:
    """(all, routed-expert) parameters of one copy on a rank of `stage`: its layers, the
    embedding on the first stage, the final norm and output layer on the last (tied embeddings
    share it at pp = 1)."""
    tp, pp = settings.tp, settings.pp
    vocab_shard = padded_vocab_size(dims.vocab, settings.make_vocab_size_divisible_by, tp) * dims.hidden // tp
    sparse = sparse_layers_of_stage(dims.moe, dims.layers, pp, stage)
    n = (stage_layers(dims, pp) - sparse) * layer_params(dims, tp) + sparse * layer_params(dims, tp, sparse=True)
    experts = 0
    if sparse:
        block, per_layer = sparse_mlp_params(dims.moe, dims.hidden, tp, settings.ep)
        n, experts = n + sparse * (block + per_layer), sparse * per_layer
    if stage == 0:
        n += vocab_shard
    if stage == pp - 1:
        n += dims.hidden + (0 if dims.tied_embeddings and pp == 1 else vocab_shard)
    return n, experts


def stage_adapter_params(dims: ModelDims, settings: MemorySettings, stage: int) -> int:
    """LoRA adapter parameters of one copy on a rank of `stage` (0 without LoRA): its dense
    layers' and, in MoE layers, the shared expert's (`lora_memory`)."""
    if settings.lora is None:
        return 0
    sparse = sparse_layers_of_stage(dims.moe, dims.layers, settings.pp, stage)
    dense = stage_layers(dims, settings.pp) - sparse
    per_dense = layer_adapter_params(dims, settings.lora, settings.tp, dims.ffn)
    per_sparse = layer_adapter_params(dims, settings.lora, settings.tp, dims.moe.shared_ffn) if sparse else 0
    return dense * per_dense + sparse * per_sparse


def layer_activation_bytes(dims: ModelDims, s: MemorySettings, sparse: bool = False) -> int:
    """Bytes autograd saves for one decoder layer (a MoE one when `sparse`) of one micro-batch,
    without recompute."""
    b, t, T = s.dtype_bytes, s.tp, s.tokens
    h, d, nq, nkv = dims.hidden, dims.head_dim, dims.heads, dims.kv_heads
    norms = 2 * (T * h * (8 + b) + 4 * T)
    qk = 0
    if dims.qk_norm:
        qk = 8 * T * (nq + nkv) * d // t + 4 * T * (nq + nkv) // t + (4 * T * (nq + nkv) * d // t if b == 4 else 0)
    rope = 4 * T * d * b
    out_proj = T * nq * d // t * b
    mlp = 5 * T * dims.ffn // t * b
    if sparse:
        mlp = sparse_mlp_activation_bytes(dims.moe, h, T, t, b)
    if s.lora is not None:
        width = dims.moe.shared_ffn if sparse else dims.ffn
        mlp += lora_activation_bytes(dims, s.lora, t, width, tokens=T, b=b)
    return norms + qk + rope + attention_core_bytes(dims, s) + out_proj + mlp


def _recomputed(dims: ModelDims, s: MemorySettings, sparse: bool = False) -> tuple[int, int]:
    """(saved bytes per layer, extra transient bytes) under ``s.recompute``."""
    full = layer_activation_bytes(dims, s, sparse)
    T, b = s.tokens, s.dtype_bytes
    if s.recompute == "full":  # each layer keeps its input; one layer is rebuilt during backward
        return T * dims.hidden * b, full
    if s.recompute == "selective":  # core attention rebuilt from q, k, v: its output and LSE go
        nq = dims.heads // s.tp
        core = attention_core_bytes(dims, s)
        kept_inputs = T * (nq + 2 * dims.kv_heads // s.tp) * dims.head_dim * b
        return full - core + kept_inputs, core
    return full, 0


def backward_working_bytes(dims: ModelDims, s: MemorySettings, sparse: bool = False) -> int:
    """Gradients alive while one layer runs backward: SwiGLU intermediates (of the k routed
    copies and the shared expert in a MoE layer), fp32 norm upcasts, and under CP the whole
    sequence's dK / dV before their reduce-scatter."""
    T = s.tokens
    width = sparse_mlp_width(dims.moe, s.tp) if sparse else dims.ffn // s.tp
    return T * (3 * width * s.dtype_bytes + 8 * dims.hidden) + kv_gather_bytes(dims, s)


def logprob_bytes(dims: ModelDims, s: MemorySettings) -> tuple[int, int]:
    """(saved, transient) bytes of the last stage's log-prob reduction of the policy."""
    vocab = padded_vocab_size(dims.vocab, s.make_vocab_size_divisible_by, s.tp) // s.tp
    n, b, chunk = s.response_rows, s.dtype_bytes, s.logprob_chunk_tokens
    per_row = vocab * 4 * (3 if s.entropy else 1)  # fp32 softmax (+ entropy terms) saved per scored row
    small = n * 17 + vocab  # targets, masks
    if chunk is None:  # logits of all T positions, then the N rows reduced at once
        return n * per_row + small, s.tokens * vocab * b + 2 * n * vocab * 4
    if not head_is_chunked(n, chunk):  # the trainer's rule (trimodel.logprobs)
        # one pass: its fp32 softmax stays for the backward; logits + one fp32 copy pass through
        return n * dims.hidden * b + small + n * per_row, n * vocab * (b + 4)
    # checkpointed chunks: only the head inputs stay; a chunk's logits and two fp32 copies live at once
    # (in the forward, and again when the backward rebuilds that chunk)
    return n * dims.hidden * b + small, chunk * vocab * (b + 8)


def optimizer_bytes_per_param(s: MemorySettings, expert: bool = False) -> float:
    """Adam state per parameter on one rank: 2 fp32 moments (+ fp32 master for bf16), / DP if
    sharded over DP × CP (/ the expert-DP size for a routed expert's parameter)."""
    per = 8 + (4 if s.dtype_bytes < 4 else 0)
    if not s.distributed_optimizer:
        return per
    return per / (s.expert_dp if expert else s.dp * s.cp)


def stage_memory(dims: ModelDims, s: MemorySettings, stage: int) -> StageMemory:
    """The memory of one rank of pipeline stage `stage` (see the module docstring)."""
    params, experts = stage_params(dims, s, stage)
    T, h, b = s.tokens, dims.hidden, s.dtype_bytes
    sparse = sparse_layers_of_stage(dims.moe, dims.layers, s.pp, stage)
    kinds = [
        (n, _recomputed(dims, s, kind), backward_working_bytes(dims, s, kind))
        for n, kind in ((stage_layers(dims, s.pp) - sparse, False), (sparse, True))
        if n
    ]
    acts = sum(n * saved for n, (saved, _), _ in kinds)
    layer_transient = max(extra + working for _, (_, extra), working in kinds)
    if stage == 0:
        acts += 8 * T  # token ids for the embedding's backward
    last = stage == s.pp - 1
    if last:  # final norm; its output is kept by the head only when the head runs on all T positions
        acts += T * h * 8 + 4 * T + (T * h * b if s.logprob_chunk_tokens is None else 0)
    else:
        acts += s.copies * T * h * b  # the [T, copies·h] activation sent on, kept for the backward
    lp_saved, lp_transient = logprob_bytes(dims, s) if last else (0, 0)
    weights, trained, optimizer = _state_bytes(dims, s, stage, params, experts)
    return StageMemory(
        stage=stage,
        params=params,
        weights=weights,
        grads=trained * 4,
        optimizer=optimizer,
        activations=acts,
        logprobs=lp_saved,
        transient=max(lp_transient, layer_transient),
        expert_params=experts,
        adapter_params=stage_adapter_params(dims, s, stage),
        kv_gather=stage_layers(dims, s.pp) * kv_gather_kept(dims, s) if s.recompute == "none" else 0,
    )


def _state_bytes(dims: ModelDims, s: MemorySettings, stage: int, params: int, experts: int) -> tuple[int, int, int]:
    """(weight bytes, trained parameters, optimizer bytes) of one rank: every copy's weights in
    model.dtype and the policy's state; with LoRA the base once (frozen: no state) and the
    adapters of each snapshot, only they trained."""
    b = s.dtype_bytes
    if s.lora is None:
        optimizer = (params - experts) * optimizer_bytes_per_param(s) + experts * optimizer_bytes_per_param(s, True)
        return params * b * s.copies, params, int(optimizer)
    adapters = stage_adapter_params(dims, s, stage)
    weights = params * b + adapters * b * s.lora.snapshots
    return weights, adapters, int(adapters * optimizer_bytes_per_param(s))


def estimate_memory(dims: ModelDims, settings: MemorySettings) -> list[StageMemory]:
    """`StageMemory` of every pipeline stage, first to last."""
    if settings.recompute not in RECOMPUTE:
        raise ValueError(f"model.megatron.recompute_granularity {settings.recompute!r} is not one of {RECOMPUTE}")
    return [stage_memory(dims, settings, s) for s in range(settings.pp)]


def with_changes(settings: MemorySettings, **changes: Any) -> MemorySettings:
    """A copy of `settings` with some fields replaced (the plan's what-if search)."""
    return replace(settings, **changes)
