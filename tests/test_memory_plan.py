"""The plan's memory model against what a real micro-step holds on the CPU (±20 %).

Subject: `megatron_rl.plan.memory.estimate_memory` for a tiny Qwen3 / Qwen2 / Llama model.
Reference: the trainer built by `trainer.build.build_policy_trainer` (megatron DDP + optimizer,
tri-model) running one packed micro-batch and one optimizer step on gloo (1 rank), measured
tensor by tensor: parameter bytes of every copy, the DDP gradient buffers, the optimizer's
state (moments and fp32 master copies), and every tensor autograd saves for the backward
(a ``saved_tensors_hooks`` pack hook, unique storages, parameters excluded).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf

PROMPT, RESPONSE, K = 64, 60, 4  # one group, uniform lengths: T = 304 packed tokens, N = 240


def _storages(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _measure(path: str, dtype: str, kl: float, megatron: dict) -> dict[str, int]:
    from megatron_rl.algorithms import LossSettings
    from megatron_rl.attention.packing import TokenGroup, pack_groups
    from megatron_rl.config.schema import AttentionConfig, ModelConfig, TrainerConfig
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trainer.build import TrainerSettings, build_policy_trainer
    from megatron_rl.trimodel.stage import unwrap

    initialize_parallel(tp=1, pp=1, platform="cpu")
    settings = TrainerSettings(hf_path=path, model=ModelConfig(hf_path=path, dtype=dtype, megatron=megatron),
                               trainer=TrainerConfig(steps=1), attention=AttentionConfig(backend="split"),
                               loss=LossSettings(kl_coef=kl))
    trainer, policy, _ = build_policy_trainer(settings)
    tri = trainer.trimodel
    copies = [unwrap(tri.policy)] + [m for m in (tri.old, tri.ref) if m is not None]
    weights = sum(p.numel() * p.element_size() for m in copies for p in m.parameters())
    param_ptrs = set(_storages(p for m in copies for p in m.parameters()))
    grads = sum(buf.grad_data.numel() * buf.grad_data.element_size() for buf in trainer.ddp.buffers)
    g = torch.Generator().manual_seed(0)
    group = TokenGroup(prompt_ids=torch.randint(0, 300, (PROMPT,), generator=g),
                       response_ids=tuple(torch.randint(0, 300, (RESPONSE,), generator=g) for _ in range(K)))
    (mb,) = pack_groups([group], token_budget=PROMPT + K * RESPONSE)
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tri.run([mb], loss=lambda lp, _i: (lp.policy.sum(), None))
    trainer.optimizer.step()
    inner = trainer.optimizer.optimizer  # torch Adam holding the moments (and fp32 masters for bf16)
    state = [t for s in inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    masters = [p for group in inner.param_groups for p in group["params"]]
    opt = {k: v for k, v in _storages(state + masters).items() if k not in param_ptrs}
    return {"params": sum(p.numel() for p in policy.parameters()), "weights": weights, "grads": grads,
            "optimizer": sum(opt.values()), "activations": sum(saved.values())}


def _plan(path, dtype: str, kl: float, recompute: str):
    from megatron_rl.models.hf_config import decoder_spec_from_hf, read_hf_config
    from megatron_rl.plan.memory import MemorySettings, MicroBatchShape, ModelDims, estimate_memory

    dims = ModelDims.from_spec(decoder_spec_from_hf(read_hf_config(path)))
    shape = MicroBatchShape(tokens=PROMPT + K * RESPONSE, prompt_len=PROMPT, response_len=RESPONSE, responses=K,
                            parts=1)
    settings = MemorySettings(tp=1, pp=1, dp=1, dtype=dtype, copies=2 if kl else 1, distributed_optimizer=False,
                              attention_backend="split", recompute=recompute, micro_batch=shape)
    (stage,) = estimate_memory(dims, settings)
    return stage


CASES = [
    ("qwen3", "float32", 0.0, "none"),
    ("qwen2", "bfloat16", 0.1, "none"),  # KL: the reference copy is resident
    ("llama", "bfloat16", 0.0, "none"),  # tied embeddings
]
# recompute (model.megatron.recompute_granularity) is not measured here: megatron's checkpoint
# reads the CUDA RNG state, which the CPU adaptor does not provide.


@pytest.mark.parametrize(("family", "dtype", "kl", "recompute"), CASES)
def test_memory_model_within_20_percent_of_measured(family, dtype, kl, recompute, tmp_path):
    path = make_tiny_hf(tmp_path / family, family, layers=4, tied=family == "llama")
    megatron = {} if recompute == "none" else {"recompute_granularity": "full", "recompute_method": "uniform",
                                               "recompute_num_layers": 1}
    (measured,) = run_distributed(_measure, 1, str(path), dtype, kl, megatron)
    plan = _plan(path, dtype, kl, recompute)
    assert plan.params == measured["params"]  # parameter count is exact
    assert plan.weights == measured["weights"]
    checks = {"grads": plan.grads, "optimizer": plan.optimizer, "activations": plan.activations + plan.logprobs}
    planned_state = plan.weights + plan.grads + plan.optimizer + plan.activations + plan.logprobs
    measured_state = sum(measured[k] for k in ("weights", "grads", "optimizer", "activations"))
    checks["total"] = planned_state
    measured["total"] = measured_state
    report = {k: (v, measured[k], round(v / measured[k], 3)) for k, v in checks.items()}
    print(family, dtype, recompute, report)  # planned, measured, ratio
    for key, (planned, got, ratio) in report.items():
        assert 0.8 <= ratio <= 1.2, f"{key}: planned {planned} vs measured {got} (ratio {ratio})"
