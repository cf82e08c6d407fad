"""``RolloutEngine.score``: prefill-only log-probs of given tokens, on both backends.

Each backend's scores are checked against two independent computations: transformers'
teacher-forced forward in this process (``hf_teacher_forced_logprobs``), and the engine's own
behaviour log-probs of the same tokens from its decode loop (KV cache, sampler), at top_p 1.
After a weight sync the scores follow the new weights and carry the new version.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rl.rollout import EngineSettings, build_engine
from megatron_rl.rollout.engine_wrapper import EngineWrapper
from megatron_rl.rollout.scoring import ScoreRequest
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import hf_teacher_forced_logprobs, request, run_all

pytestmark = [pytest.mark.multiproc]

PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("engine_score") / "qwen2", "qwen2", seed=3, layers=2)


def _sampled(engine):
    reqs = [request(f"r{i}", p, temperature=1.0, max_new=6, seed=20 + i) for i, p in enumerate(PROMPTS)]
    return list(run_all(engine, reqs).values())


def _score(engine, results, temperature=1.0):
    return engine.score(
        [
            ScoreRequest(
                request_id=r.request_id, prompt_ids=r.prompt_ids, response_ids=r.response_ids, temperature=temperature
            )
            for r in results
        ]
    )


def _check_against_references(engine, hf_dir, *, temperatures, atol):
    results = _sampled(engine)
    for temperature in temperatures:
        scores = _score(engine, results, temperature)
        assert [s.request_id for s in scores] == [r.request_id for r in results]  # request order
        for r, s in zip(results, scores, strict=True):
            assert s.weight_version == engine.weight_version
            ref, _ = hf_teacher_forced_logprobs(hf_dir, r.prompt_ids, r.response_ids, temperature)
            torch.testing.assert_close(torch.tensor(s.logprobs, dtype=torch.float64), ref, rtol=0, atol=atol)
            if temperature == 1.0:  # the engine's own sampled log-probs (top_p 1: the plain log-prob)
                torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(r.logprobs), rtol=0, atol=atol)


def test_hf_scores_equal_teacher_forced_and_sampled_logprobs(hf_dir):
    cores = sorted(os.sched_getaffinity(0))
    engine = EngineWrapper(
        build_engine(
            EngineSettings(
                dtype="float32",
                engine="hf",
                model_path=str(hf_dir),
                num_engines=2,
                devices=(f"cpu:{cores[0]}", f"cpu:{cores[-1]}"),
                max_batch_size=3,
            )
        )
    )
    try:
        _check_against_references(engine, hf_dir, temperatures=(1.0, 0.7), atol=1e-4)
        with pytest.raises(ValueError, match="appears twice"):
            engine.score([ScoreRequest(request_id="a", prompt_ids=(1,), response_ids=(2,))] * 2)
    finally:
        engine.shutdown()


@pytest.mark.vllm
def test_vllm_scores_at_temperature_one_only(hf_dir):
    pytest.importorskip("vllm")
    from megatron_rl.rollout import RolloutWorkerError

    engine = build_engine(
        EngineSettings(
            engine="vllm",
            dtype="float32",
            model_path=str(hf_dir),
            num_engines=1,
            devices=(f"cpu:{max(os.sched_getaffinity(0))}",),
            max_batch_size=4,
        )
    )
    try:
        _check_against_references(engine, hf_dir, temperatures=(1.0,), atol=1e-4)
        with pytest.raises(RolloutWorkerError, match="temperature 1 only"):
            _score(engine, _sampled(engine)[:1], temperature=0.7)
    finally:
        engine.shutdown()
