"""The plan's memory model against what a real micro-step holds on the CPU (±20 %).

Subject: `megatron_rl.plan.memory.estimate_memory` for a tiny Qwen3 / Qwen2 / Llama model.
Reference: the trainer built by `trainer.build.build_policy_trainer` (megatron DDP + optimizer,
tri-model) running one packed micro-batch and one optimizer step on gloo (1 rank), measured
tensor by tensor: parameter bytes of every copy, the DDP gradient buffers, the optimizer's
state (moments and fp32 master copies), and every tensor autograd saves for the backward
(a ``saved_tensors_hooks`` pack hook, unique storages, parameters excluded), and the peak
resident memory of the micro-step: the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) over the resident size before it, with glibc told to serve every
allocation above 64 KiB by mmap (``MALLOC_MMAP_THRESHOLD_``) so freed tensors leave the RSS.
That peak is compared with the plan's activations + log-probs + transient. A 32k-vocabulary
model checks the log-prob buffers (one pass, and checkpointed chunks) where they dominate.

Recompute (``model.megatron.recompute_granularity`` full / selective): only what the forward
saves counts as activations (tensors the backward's recomputation saves are the transient), and
megatron's checkpoint gets the CPU generator for its "CUDA" RNG state (``_cpu_rng_for_checkpoint``;
the CPU adaptor does not provide it). The plan's full-recompute peak is conservative (it adds the
rebuilt layer and the backward working set): measured ratios 1.32 (qwen3 fp32), 1.35 (llama
fp32), 1.47 (qwen2 bf16), hence its own upper bound; a 2x error still fails.

Where ``/proc/self/clear_refs`` is missing (not Linux) the peak cannot be reset: every other
term is still compared and the peak comparison is skipped with a warning in the summary.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PROMPT, RESPONSE, K = 256, 256, 4  # one group, uniform lengths: T = 1280 packed tokens, N = 1024
CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _cpu_rng_for_checkpoint() -> None:
    """megatron's activation checkpoint saves and restores the CUDA RNG state through
    ``torch.cuda.random``, which a CPU build lacks: give it the CPU generator (memory unchanged)."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _measure(path: str, dtype: str, kl: float, megatron: dict, tp: int, pp: int, chunk: int = 4096) -> dict[str, int]:
    from megatron.core import parallel_state

    from megatron_rl.algorithms import LossSettings
    from megatron_rl.attention.packing import TokenGroup, pack_groups
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, TrainerConfig
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import TrainerSettings, build_policy_trainer
    from megatron_rl.trimodel.stage import unwrap

    initialize_parallel(tp=tp, pp=pp, platform="cpu")
    if megatron.get("recompute_granularity"):
        _cpu_rng_for_checkpoint()
    settings = TrainerSettings(
        hf_path=path,
        model=ModelConfig(hf_path=path, dtype=dtype, megatron=megatron),
        trainer=TrainerConfig(steps=1, logprob_chunk_tokens=chunk),
        attention=AttentionConfig(backend="split"),
        loss=LossSettings(kl_coef=kl),
    )
    trainer, policy, _ = build_policy_trainer(settings)
    tri = trainer.trimodel
    copies = [unwrap(tri.policy)] + [m for m in (tri.old, tri.ref) if m is not None]
    weights = sum(p.numel() * p.element_size() for m in copies for p in m.parameters())
    param_ptrs = set(_storages(p for m in copies for p in m.parameters()))
    grads = sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in trainer.ddp.buffers)
    g = torch.Generator().manual_seed(0)
    group = TokenGroup(
        prompt_ids=torch.randint(0, 300, (PROMPT,), generator=g),
        response_ids=tuple(torch.randint(0, 300, (RESPONSE,), generator=g) for _ in range(K)),
    )
    (mb,) = pack_groups([group], token_budget=PROMPT + K * RESPONSE)
    step = lambda: tri.run([mb], loss=lambda lp, _i: (lp.policy.sum(), None), finalize_grads=False)  # noqa: E731
    step()  # warm-up: first-call caches and buffers are not the micro-step's
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        in_backward = torch._C._current_graph_task_id() != -1  # a recompute's saves are transient
        if ptr not in param_ptrs and not in_backward:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    before = _status_bytes("VmRSS")
    if CLEAR_REFS.exists():
        CLEAR_REFS.write_text("5")  # reset the high-water mark to the current RSS
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    peak_rise = _status_bytes("VmHWM") - before if CLEAR_REFS.exists() else None
    trainer.optimizer.step()
    inner = trainer.optimizer.optimizer  # torch Adam holding the moments (and fp32 masters for bf16)
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    masters = [p for group in inner.param_groups for p in group["params"]]
    opt = {k: v for k, v in _storages(state + masters).items() if k not in param_ptrs}
    return {
        "params": sum(p.numel() for p in policy.parameters()),
        "weights": weights,
        "grads": grads,
        "optimizer": sum(opt.values()),
        "activations": sum(saved.values()),
        "peak_rise": peak_rise,
        "stage": parallel_state.get_pipeline_model_parallel_rank(),
    }


def _plan(path, dtype: str, kl: float, recompute: str, tp: int, pp: int, chunk: int = 4096):
    from megatron_rl.models.hf_config import decoder_spec_from_hf, read_hf_config
    from megatron_rl.plan.memory import MemorySettings, MicroBatchShape, ModelDims, estimate_memory

    dims = ModelDims.from_spec(decoder_spec_from_hf(read_hf_config(path)))
    shape = MicroBatchShape(
        tokens=PROMPT + K * RESPONSE, prompt_len=PROMPT, response_len=RESPONSE, responses=K, parts=1
    )
    settings = MemorySettings(
        tp=tp,
        pp=pp,
        dp=1,
        dtype=dtype,
        copies=2 if kl else 1,
        distributed_optimizer=False,
        attention_backend="split",
        recompute=recompute,
        micro_batch=shape,
        logprob_chunk_tokens=chunk,
    )
    return estimate_memory(dims, settings)


CASES = [  # family, dtype, KL coefficient, recompute, tp, pp
    ("qwen3", "float32", 0.0, "none", 1, 1),
    ("qwen2", "bfloat16", 0.1, "none", 1, 1),  # KL: the reference copy is resident
    ("llama", "bfloat16", 0.0, "none", 1, 1),  # tied embeddings
    ("qwen3", "bfloat16", 0.0, "none", 2, 1),  # TP shards heads, FFN and vocabulary
    ("qwen2", "float32", 0.1, "none", 1, 2),  # PP: embedding on stage 0, output layer and log-probs on stage 1
    ("qwen3", "float32", 0.0, "full", 1, 1),  # each layer keeps its input; one rebuilt in the backward
    ("qwen3", "float32", 0.0, "selective", 1, 1),  # core attention rebuilt from q, k, v
]
PEAK_HIGH = {"full": 1.5}  # the plan's full-recompute transient is conservative (module docstring)
RECOMPUTE_SETTINGS = {
    "none": {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


@pytest.mark.parametrize(("family", "dtype", "kl", "recompute", "tp", "pp"), CASES)
def test_memory_model_within_20_percent_of_measured(family, dtype, kl, recompute, tp, pp, tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned rank's glibc at start
    path = make_tiny_hf(tmp_path / family, family, layers=4, tied=family == "llama")
    stages = _plan(path, dtype, kl, recompute, tp, pp)
    for measured in run_distributed(
        _measure, tp * pp, str(path), dtype, kl, RECOMPUTE_SETTINGS[recompute], tp, pp, fresh=True
    ):  # measures its own process memory
        _compare(
            stages[measured["stage"]],
            measured,
            f"{family} {dtype} tp{tp} pp{pp} recompute {recompute}",
            peak_high=PEAK_HIGH.get(recompute, 1.2),
        )


def _compare(plan, measured: dict[str, int], case: str, peak_high: float = 1.2) -> None:
    assert plan.params == measured["params"]  # parameter count is exact
    assert plan.weights == measured["weights"]
    checks = {"grads": plan.grads, "optimizer": plan.optimizer, "activations": plan.activations + plan.logprobs}
    if measured["peak_rise"] is None:
        warnings.warn(
            f"{case}: peak memory NOT compared with the plan: /proc/self/clear_refs is missing, so the "
            "peak RSS cannot be reset (Linux only)",
            stacklevel=2,
        )
    else:
        checks |= {"peak_rise": plan.activations + plan.logprobs + plan.transient, "total": plan.total}
        measured["total"] = sum(measured[k] for k in ("weights", "grads", "optimizer", "peak_rise"))
    report = {k: (v, measured[k], round(v / measured[k], 3)) for k, v in checks.items()}
    print(case, f"stage {plan.stage}", report)  # planned, measured, ratio
    for key, (planned, got, ratio) in report.items():
        high = peak_high if key in ("peak_rise", "total") else 1.2
        assert 0.8 <= ratio <= high, f"{key}: planned {planned} vs measured {got} (ratio {ratio})"


def _large_vocab_model(path: Path) -> Path:
    """A 2-layer Qwen2 with a 32k vocabulary: its log-prob buffers outweigh the activations."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.mark.parametrize("chunk", [4096, 256])  # N = 1024 rows: one chunk, or 4 checkpointed chunks
def test_logprob_buffers_within_20_percent_of_measured(chunk, tmp_path, monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    path = _large_vocab_model(tmp_path / "qwen2-32k")
    (stage,) = _plan(path, "bfloat16", 0.0, "none", 1, 1, chunk)
    (measured,) = run_distributed(_measure, 1, str(path), "bfloat16", 0.0, {}, 1, 1, chunk, fresh=True)
    _compare(stage, measured, f"qwen2 32k vocab bf16 chunk {chunk}")
