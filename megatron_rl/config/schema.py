"""The config tree: keyword-only frozen dataclasses mirroring the YAML file, section by section.

Contract: class and field names are the YAML keys (``algorithm.clip.high`` is
``Config.algorithm.clip.high``) and are imported by the rest of the package. A field without
a default is required. Only the types the converter in `convert.py` understands appear here:
int, float, bool, str, Literal, X | None, list[int] / list[str], nested dataclasses, and
``dict[str, Any]`` for options passed through untouched to megatron-core or vLLM. The rules
on a section's values live in `fields.py` (one field) and `sections.py` (several fields of one
section), the rules across sections in `validate.py`; components built from Python run the
same functions. Name lists (backends, dtypes, modes) are ``get_args`` of the Literals below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from .schema_agent import AgentConfig
from .schema_lora import LoraConfig

# Every enum of the config, declared once; the components import these.
DType = Literal["float32", "bfloat16"]
AttentionBackend = Literal["auto", "reference", "split", "flex", "triton", "npu"]
LossName = Literal["grpo", "bnpo", "dapo", "dr_grpo", "ppo_decoupled", "distill"]
PipelineMode = Literal["sync", "periodic", "stale"]
AdvantageScale = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
ProximalMode = Literal["recompute", "loglinear"]
# token_*: r_t = exp(δ_t); sequence_*: r = exp(Σ_t δ_t) (TRL); geometric_*: r = exp(mean_t δ_t) (verl's
# geometric level: does not collapse with length as the sequence product does).
CorrectionMode = Literal[
    "none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "geometric_truncate", "geometric_mask"
]
AlarmAction = Literal["warn", "stop"]
EngineName = Literal["vllm", "hf"]
WeightSync = Literal["snapshot", "broadcast", "shared_memory"]
DeviceKind = Literal["cpu", "cuda", "npu"]  # the kinds a rollout.devices string may start with
RoutingReplay = Literal["none", "rollout"]  # MoE: the trainer's routers choose, or replay the engine's routes
MoeLoadBalancing = Literal["aux_loss", "seq_aux_loss", "none"]  # megatron's router load-balancing losses
BuiltinController = Literal["fixed", "sagc"]  # control.kind names; any other kind is a dotted path
# environment.kind names ("none": single-turn rollouts); any other kind is a dotted path
BuiltinEnvironment = Literal["none", "echo", "calculator", "python"]
# rollout.generator names (megatron_rl.generation's registry); any other generator is a dotted path
BuiltinGenerator = Literal["auto", "single_turn", "multi_turn", "agent"]


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    """Router losses of a mixture-of-experts policy (ignored for dense models), added to the RL loss
    in backward by megatron-core.

    Effective weight (what the optimizer step sees). Each sparse layer's loss is megatron's
    per-micro-batch value L_m (aux_loss: E·Σ_e f_e·P_e over the micro-batch's packed tokens, ~1
    when balanced; z-loss: the mean over those tokens of logsumexp²) times the coefficient. The
    step's objective gets coeff · Σ_m (d_m / D) · L_m over all micro-batches of the mini-batch
    (every DP replica): their mean weighted as the RL loss weights them, d_m being micro-batch
    m's share of the RL loss denominator D (response tokens; sequences for grpo and dr_grpo).
    So coeff · L for one micro-batch, the plain mean for equal shares, whatever the DP size or
    D's magnitude (``platform/patches/moe_aux_loss_scale`` says how, and why not the unweighted mean).
    """

    # load-balancing loss: per micro-batch (aux_loss), per sequence (seq_aux_loss), or none
    load_balancing: MoeLoadBalancing = "aux_loss"
    aux_loss_coeff: float = 0.0  # its weight; 0 = off (HF checkpoints' router_aux_loss_coef is not read)
    z_loss_coeff: float = 0.0  # router z-loss (logsumexp of router logits squared) weight; 0 = off


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The policy model (also the old policy and the reference: same weights at start)."""

    hf_path: str  # local HF checkpoint dir (config.json + safetensors); relative to the cwd
    dtype: DType = "bfloat16"  # parameter and compute dtype of all three models
    make_vocab_size_divisible_by: int = 128  # megatron pads the vocab to a multiple of this × tp
    # Pass-through TransformerConfig fields (e.g. recompute_granularity); names are checked
    # against megatron-core; fields set from the HF config or from `parallel` are refused.
    megatron: dict[str, Any] = field(default_factory=dict)
    moe: MoeConfig = field(default_factory=MoeConfig)  # router losses (MoE models)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How training ranks split the model (megatron-core parallel state)."""

    tp: int = 1  # tensor-parallel size; divides heads, KV heads and FFN width
    pp: int = 1  # pipeline-parallel size; divides the number of layers
    # context-parallel size: each CP rank holds a load-balanced slice of every packed micro-batch
    # and all-gathers K / V per layer; world = tp × pp × cp × dp
    cp: int = 1
    dp: int | None = None  # data-parallel size; None = world size / (tp × pp × cp)
    ep: int = 1  # expert-parallel size (MoE models): splits the routed experts; divides num_experts and dp
    distributed_optimizer: bool = False  # shard optimizer state across DP ranks (megatron)
    # How long a rank may wait for the rest of the world, generation included: rank 0 for the
    # pipeline's next group, every process group (torch, megatron, host gloo) for its peers
    # (+30 s grace); past it every rank raises an error naming this key (parallel.world_timeout).
    timeout_s: float = 1800.0


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Shared-prompt attention: how a group [prompt, r_1, …, r_K] is laid out and computed."""

    backend: AttentionBackend = "auto"  # auto picks by device; npu needs torch_npu (checked at run)
    # false: pack every response after its own copy of the prompt (the K-copies layout), the
    # baseline shared-prompt packing is measured against; same update, more tokens per micro-batch.
    shared_prompt: bool = True


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """Group-relative advantage A_i = (r_i - group mean) / (std + eps) (algorithms/advantages.py)."""

    scale: AdvantageScale = "group"  # std that divides: group's, batch's, none (Dr.GRPO)
    eps: float = 1e-6  # added to the std before dividing


@dataclass(frozen=True, kw_only=True)
class ClipConfig:
    """PPO ratio clip range [1 - low, 1 + high]; DAPO's clip-higher uses high > low."""

    low: float = 0.2  # lower clip epsilon, in (0, 1)
    high: float = 0.2  # upper clip epsilon, >= low


@dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    """DAPO soft overlong punishment over the last `buffer` tokens before max_new_tokens."""

    enabled: bool = False  # add the length penalty to the reward
    buffer: int = 0  # length of the penalty ramp in tokens; 0 < buffer < max_new_tokens
    penalty: float = 1.0  # penalty at max_new_tokens (ramps linearly from 0 over the buffer)


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    """KL penalty to the reference model, added to the loss."""

    coef: float = 0.0  # weight of the KL term; 0 skips the reference forward's use in the loss
    estimator: KLEstimator = "k3"  # Schulman's estimators (k3 = unbiased, >= 0)


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Engine vs trainer log-prob correction, TRL's vllm_importance_sampling_* (algorithms/correction.py)."""

    # none | token_truncate | token_mask | sequence_truncate | sequence_mask (TRL's default; use it
    # with bf16 / vLLM engines). none by default: an fp32 engine matches the trainer to ~1e-7 and a
    # weight of 1 ± 1e-6 would only add noise (and break exact periodic == sync equivalence).
    # ppo_decoupled takes none or a *_mask mode (its behaviour weight is the importance weight).
    mode: CorrectionMode = "none"
    c_min: float | None = None  # lower bound C_min of the ratio π_trainer/π_behav; None = unbounded
    c_max: float | None = 3.0  # upper bound C_max of the ratio; None = unbounded
    delta: float | None = None  # DeepSeek-V3.2 off-policy masking: drop A<0 sequences with KL > delta
    # Engine probe (trainer/engine_probe.py): after each weight sync the engines score this many just-
    # trained sequences and the trainer compares (mismatch_probe/*, read by the alarm); 0 = off;
    # None = 4 in pipeline.mode stale (its samples are all stale: the loss measures nothing), else 0.
    probe_sequences: int | None = None


@dataclass(frozen=True, kw_only=True)
class MismatchAlarmConfig:
    """Gate on each optimizer step's mismatch/... metrics; a None threshold is not checked."""

    logprob_abs_diff_mean: float | None = None  # mean |log π_trainer − log π_behav|
    logprob_abs_diff_max: float | None = None  # max of the same
    kl_k3: float | None = 0.05  # token mean of k3 KL(π_behav ‖ π_trainer)
    seq_ratio_max: float | None = None  # largest sequence ratio exp(Σ log π_trainer/π_behav)
    masked_fraction: float | None = None  # fraction of tokens the correction dropped
    action: AlarmAction = "warn"  # warn: log and step; stop: raise before the step


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The policy-gradient objective."""

    loss: LossName = "grpo"  # token aggregation + clipping family
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)  # advantage estimator
    clip: ClipConfig = field(default_factory=ClipConfig)  # ratio clipping
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    # DAPO over-sampling (with dynamic_sampling): draw ceil(prompts_per_batch x oversample) prompts,
    # train the first prompts_per_batch kept groups in prompt order, abort the rest once decided; 1 = off
    oversample: float = 1.0
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO length penalty
    proximal: ProximalMode = "recompute"  # decoupled PPO proximal policy (A-3PO = loglinear)
    behav_weight_cap: float | None = None  # decoupled PPO: cap on π_prox/π_behav; None = no cap
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)  # engine mismatch
    mismatch_alarm: MismatchAlarmConfig = field(default_factory=MismatchAlarmConfig)  # engine mismatch gate
    kl: KLConfig = field(default_factory=KLConfig)  # KL-to-reference penalty
    entropy_coef: float = 0.0  # entropy bonus weight
    temperature: float = 1.0  # log-prob temperature; must equal rollout.sampling.temperature
    # MoE routing replay (R3): "rollout" forces the engine's expert choice on the policy and old copies
    # (the reference routes itself: trimodel/routing.py); "none" lets every router choose.
    routing_replay: RoutingReplay = "none"


@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """Generation parameters sent with every rollout request."""

    temperature: float = 1.0  # sampling temperature, > 0
    top_p: float = 1.0  # nucleus sampling mass, in (0, 1]
    max_new_tokens: int = 256  # response length cap
    stop: list[str] = field(default_factory=list)  # extra stop strings (EOS always stops)
    seed: int = 0  # base sampling seed


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """Rollout engines: separate processes on devices of their own (never training ranks)."""

    engine: EngineName = "hf"  # vllm (or vllm-ascend), or the embedded CPU/HF engine
    num_engines: int = 1  # number of engine processes
    # One device string per engine: "cpu", "cpu:1" / "cpu:0-3" (pinned cores), "cuda:4" or, for an
    # engine with tensor_parallel_size 2, "cuda:4,5"; "npu:0,1" likewise. [] = unpinned CPU engines.
    devices: list[str] = field(default_factory=list)
    # The launch node (node rank) of each engine, one entry per engine; [] = every engine on node 0.
    # Node 0's engines are rank 0's own workers; node N > 0's run in that node's engine host
    # (`python -m megatron_rl serve`, started by the launchers), reached over the network.
    engine_nodes: list[int] = field(default_factory=list)
    engine_port: int = 29501  # rank 0's engine hub listens here (on sync_address) for remote engine hosts
    tensor_parallel_size: int = 1  # TP size inside each engine
    # Engine weights and compute dtype; None = model.dtype. A bf16 engine with an fp32 trainer
    # is supported: the gap shows in the mismatch/... metrics (algorithm.rollout_correction).
    dtype: DType | None = None
    # Requests a worker decodes at once (vLLM's max_num_seqs). Every request of a step should fit:
    # one continuous batch, and groups still complete one by one as their last member finishes.
    max_batch_size: int = 256
    # shared_memory (engines on the trainer's machine): each PP stage writes a /dev/shm file the
    # engines copy from (fastest: 0.2 s for 0.54 GB); broadcast: gloo/NCCL/HCCL in flat buckets
    # (engines on other machines); snapshot: a HF safetensors snapshot the engines reload.
    weight_sync: WeightSync = "shared_memory"
    # snapshot (and shared-memory) files go to a fresh directory in rank 0's /dev/shm; with pipeline
    # stages or engines on other nodes, set this to a directory every node mounts (snapshot only).
    snapshot_dir: str | None = None
    sync_address: str = "127.0.0.1"  # the broadcast group's listeners bind to this address only
    sync_bucket_mb: int = 256  # broadcast sync: tensors travel packed in flat buckets of this many MiB
    # A worker with work in flight that sends nothing for this long is hung: killed, restarted,
    # its requests re-issued. Must exceed the slowest request (and weight load).
    request_timeout_s: float = 600.0
    start_timeout_s: float = 600.0  # an engine not ready this long after its start (model load) is an error
    max_restarts: int = 3  # worker failures (deaths, hangs) tolerated per engine call; then an error
    # pipeline.mode 'stale': weight syncs reach running requests between decode steps (KV recomputed,
    # each token records the version that sampled it; README: Partial rollout / in-flight updates)
    in_flight_updates: bool = False
    # partial rollout: the prompts algorithm.oversample aborts continue, with their tokens, next batch
    carry_over: bool = False
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # generation parameters
    # How a batch's trajectories are generated (megatron_rl.generation): auto = single_turn for
    # environment.kind 'none', else multi_turn (the environment's turns); or "pkg.mod:factory", a
    # function or class taking a generation.GeneratorSetup and returning a Generator.
    generator: str = "auto"
    # Write every scored group (tokens, log-probs, rewards, versions) to this JSONL file, for
    # `python -m megatron_rl replay CONFIG FILE`; None = no recording.
    record: str | None = None
    vllm: dict[str, Any] = field(default_factory=dict)  # pass-through vLLM engine kwargs


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Producer/consumer scheduling between rollout and training."""

    mode: PipelineMode = "periodic"  # sync loop, periodic asynchrony (on-policy), or stale (off-policy)
    max_staleness: int = 0  # stale mode: max policy versions a sample may lag (>= 1); else 0
    queue_size: int = 64  # max groups waiting between producer and consumer
    micro_batch_tokens: int = 4096  # token budget of one packed micro-batch


@dataclass(frozen=True, kw_only=True)
class SAGCConfig:
    """Straggler-aware group control: Thompson sampling over G with a dual-ascent λ."""

    candidates: list[int] = field(default_factory=lambda: [4, 8, 16])  # allowed G, strictly increasing
    tau: float = 3.0  # straggler threshold on max/median response length, > 1 (fixed G logs stragglers by it too)
    delta: float = 0.1  # target straggler rate, in (0, 1)
    gamma: float = 0.99  # forgetting factor of the Beta posteriors, in (0, 1]
    eta: float = 0.5  # dual-ascent step size for λ
    lambda_max: float = 20.0  # projection bound of λ, λ ∈ [0, lambda_max]
    prior_alpha: float = 1.0  # Beta prior α of the straggler probability
    prior_beta: float = 1.0  # Beta prior β of the straggler probability
    forget_unchosen: bool = True  # also decay the evidence of candidates not chosen this step
    seed: int = 0  # seed of the Thompson-sampling generator


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Group-size controller: how many responses G per prompt the next rollout asks for."""

    kind: str = "fixed"  # "fixed", "sagc", or a dotted path "pkg.mod:Class"
    group_size: int = 8  # G for fixed; the starting G for sagc (must be a candidate)
    sagc: SAGCConfig = field(default_factory=SAGCConfig)  # used when kind == "sagc"
    options: dict[str, Any] = field(default_factory=dict)  # kwargs of a dotted-path controller class


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Prompt dataset."""

    source: str  # "reasoning_gym:<dataset>" or a path to a .jsonl / .parquet file
    prompt_key: str = "question"  # record field holding the prompt
    answer_key: str = "answer"  # record field holding the reference answer
    size: int = 1000  # number of prompts (generated for reasoning_gym, truncated for files)
    seed: int = 0  # dataset generation / shuffling seed
    max_prompt_tokens: int = 512  # longer prompts are dropped (counted, never truncated)
    chat_template: bool = True  # wrap prompts with the tokenizer's chat template
    # Appended (after a blank line) to each prompt's last user turn; null = the prompt as it is.
    instruction: str | None = "Please reason step by step, and put your final answer within \\boxed{}."
    # reasoning_gym sources only: keyword arguments of its dataset config, e.g. {min_terms: 2,
    # max_terms: 2, max_digits: 1} for basic_arithmetic
    options: dict[str, Any] = field(default_factory=dict)
    skip_bad_rows: bool = True  # skip (and count) malformed file rows; false: the first one is an error


from .schema_reward_model import JudgeConfig, RewardKind, RewardModelConfig  # noqa: E402 (reuses the enums above)


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """The reward of each finished response: a function, an LLM judge, a reward model, or a weighted sum."""

    kind: RewardKind = "function"  # function (reward.fn), judge, model, or combined (reward.weights)
    # combined only: component (function, judge, model) -> weight; reward = sum of weight × component reward
    weights: dict[str, float] = field(default_factory=dict)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # an LLM judge (kind judge, or combined)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)  # a reward model (kind model, or combined)
    fn: str = "math_verify"  # builtin name or dotted path "pkg.mod:function"
    # A call running longer scores 0 (counted); so do calls that raise or return a non-number.
    timeout_s: float = 30.0
    # Processes scoring rewards in parallel, off the producer thread (a hung call's process is
    # killed and replaced); 0 = in the producer thread, one call at a time.
    workers: int = 0


@dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """Multi-turn rollouts: the environment (tools, sandbox, task) each trajectory talks to."""

    # "none" (one response per prompt), a builtin (echo, calculator, python) or a dotted path
    # "pkg.mod:Factory" to a class / function returning a megatron_rl.environments.Environment
    kind: str = "none"
    options: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment factory
    max_turns: int = 4  # model turns per trajectory; a trajectory still going after the last is truncated (flagged)
    # prompt + model + observation tokens per trajectory; one that would exceed it is truncated (flagged)
    max_total_tokens: int = 4096
    # An environment call (reset / step) running longer ends its trajectory as a counted failure.
    step_timeout_s: float = 60.0
    # Environment calls that raised or timed out, over the run, before it stops with an error; null: never
    max_failures: int | None = 100


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """The training loop, optimizer and checkpoints."""

    steps: int  # number of rollout batches (iterations)
    prompts_per_batch: int = 8  # prompts per rollout batch (each gets G responses)
    mini_batches: int = 1  # optimizer steps per rollout batch; divides prompts_per_batch
    lr: float = 1e-6  # Adam learning rate (constant)
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # global grad-norm clip; 0 disables
    adam_beta1: float = 0.9  # Adam β1
    adam_beta2: float = 0.999  # Adam β2
    adam_eps: float = 1e-8  # Adam ε
    seed: int = 1234  # model/optimizer RNG seed
    save_dir: str | None = None  # checkpoint dir; None = no checkpoints
    save_every: int = 0  # save every N steps (0 = only at the end, if save_dir is set)
    # A checkpoint dir written by save_dir (<save_dir>/step_N) to continue from; "auto": the last
    # complete one in save_dir, or a fresh start if there is none (a restarted world: launchers' --max-restarts)
    resume_from: str | None = None
    log_dir: str | None = None  # metrics dir (jsonl); None = stdout only
    offload_reference: bool = False  # keep the reference model on CPU between uses
    offload_old: bool = False  # keep the old-policy snapshot on CPU between uses
    # Optimizer steps skipped in a row because the loss or a gradient was NaN / inf (same verdict on
    # every rank) before the run stops with an error; each skip is counted in train/nonfinite_steps.
    max_nonfinite_steps: int = 3
    # Response positions whose logits (fp32, [n, vocab/tp]) are materialised at once when computing
    # log-probs; longer micro-batches are scored in chunks (recomputed in backward for the policy).
    logprob_chunk_tokens: int = 4096


from .schema_distill import DistillConfig  # noqa: E402 (reuses the enums above)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run: one YAML file, one `Config`."""

    model: ModelConfig  # policy / old / reference model
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP × PP × DP
    attention: AttentionConfig = field(default_factory=AttentionConfig)  # shared-prompt attention
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)  # loss and advantages
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # engines and sampling
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # sync / periodic / stale
    control: ControlConfig = field(default_factory=ControlConfig)  # group-size controller
    data: DataConfig  # prompt dataset
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward function
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)  # multi-turn environment
    agent: AgentConfig = field(default_factory=AgentConfig)  # OpenAI-API agents (rollout.generator: agent)
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation from a teacher
    lora: LoraConfig = field(default_factory=LoraConfig)  # low-rank adapters (rank 0: full fine-tuning)
    trainer: TrainerConfig  # loop, optimizer, checkpoints
