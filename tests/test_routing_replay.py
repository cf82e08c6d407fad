"""Routing replay: the engine's routes reach the trainer's routers unchanged, exactly.

- Data path: a group's routes through ``to_token_group`` / ``pack_group`` / ``concat_groups``,
  ``split_group`` parts, the K-copies layout and the JSONL recording, against the packed order
  written out here from the samples (prompt once from sample 0, each response's rows, the
  never-forwarded last token repeating its predecessor).
- ``hf`` engine: the routes it records while decoding (batched, left-padded, KV cache) equal the
  routes of one plain transformers forward of prompt + response (``output_router_logits``: the
  top-k of the softmax of each MoE layer's router logits), token by token.
(The trainer side: ``test_routing_replay_trainer.py``.)
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_rl.attention.packing import concat_groups, k_copies, pack_group
from megatron_rl.pipeline.records import (
    Sample,
    ScoredGroup,
    make_micro_batch,
    split_group,
    to_token_group,
    unshare_prompts,
)
from megatron_rl.rollout.types import RoutedExperts
from tests.hf_moe_models import make_tiny_moe

VOCAB, LAYERS, EXPERTS, TOP_K = 300, 4, 4, 2  # tests.hf_moe_models' qwen3_moe (layer 1 dense)


def _sample(k: int, prompt: tuple[int, ...], n: int, rng: np.random.Generator, routes: bool = True) -> Sample:
    rows = len(prompt) + n - 1
    idx = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(rows * LAYERS)]).reshape(rows, LAYERS, TOP_K)
    return Sample(
        prompt_id="p",
        request_id=f"0/p/{k}",
        index=k,
        prompt_ids=prompt,
        response_ids=tuple(int(t) for t in rng.integers(0, VOCAB, n)),
        behav_logprobs=(-1.0,) * n,
        weight_version=0,
        finish_reason="length",
        reward=float(k),
        routed_experts=RoutedExperts(idx) if routes else None,
    )


def _group(samples) -> ScoredGroup:
    g = len(samples)
    return ScoredGroup(
        step=0,
        prompt_index=0,
        prompt_id="p",
        samples=tuple(samples),
        rewards=torch.arange(g, dtype=torch.float32),
        advantages=torch.arange(g, dtype=torch.float32),
        kept=True,
    )


def _expected(samples, prompt_from: Sample | None = None) -> torch.Tensor:
    """Packed order by hand: prompt rows of sample 0 (or ``prompt_from``), then each response's
    rows + its last again."""
    lp = len(samples[0].prompt_ids)
    rows = [(prompt_from or samples[0]).routed_experts.indices[:lp]]
    for s in samples:
        r = s.routed_experts.indices
        rows += [r[lp:], r[-1:]]
    return torch.from_numpy(np.concatenate(rows))


def test_routes_survive_packing_splits_and_recording():
    from megatron_rl.pipeline.recording import item_from_json, item_to_json

    rng = np.random.default_rng(0)
    prompt = (5, 6, 7, 8)
    samples = [_sample(k, prompt, n, rng) for k, n in enumerate((3, 1, 5))]
    group = _group(samples)
    packed = concat_groups([pack_group(to_token_group(group))])
    assert torch.equal(packed.routed_experts, _expected(samples))
    assert packed.routed_experts.shape[0] == packed.num_tokens
    parts = split_group(group, token_budget=len(prompt) + 5)  # [r0, r1], [r2]
    assert [len(p.samples) for p in parts] == [2, 1]
    for part in parts:
        assert torch.equal(pack_group(to_token_group(part)).routed_experts, _expected(part.samples))
    copies = k_copies([to_token_group(group)])  # one shared prompt: sample 0's routes in every copy
    for s, copy in zip(samples, copies, strict=True):
        assert torch.equal(pack_group(copy).routed_experts, _expected([s], prompt_from=samples[0]))
    mb = make_micro_batch([group], policy_version=0)
    unshared = unshare_prompts(mb)  # a copy of the prompt per response: each with its own sample's routes
    assert torch.equal(unshared.packed.routed_experts, torch.cat([_expected([s]) for s in samples]))
    assert torch.equal(mb.to(torch.device("cpu")).packed.routed_experts, mb.packed.routed_experts)
    back = item_from_json(json.loads(json.dumps(item_to_json(group))))
    assert [s.routed_experts for s in back.samples] == [s.routed_experts for s in samples]


def test_missing_or_misshapen_routes_are_named():
    rng = np.random.default_rng(1)
    with_routes, without = _sample(0, (1, 2, 3), 2, rng), _sample(1, (1, 2, 3), 2, rng, routes=False)
    with pytest.raises(ValueError, match="request '0/p/1' has no routed experts"):
        to_token_group(_group([with_routes, without]))
    from megatron_rl.trimodel.routing import require_routes

    with pytest.raises(ValueError, match="routing_replay is 'rollout' but request '0/p/1' has no routed experts"):
        require_routes([with_routes, without])  # rank 0's check before a micro-batch is trained or shipped
    short = RoutedExperts(with_routes.routed_experts.indices[:-1])
    with pytest.raises(ValueError, match="request '0/p/0': routes for 3 tokens, the engine forwarded 4"):
        Sample(**{**with_routes.__dict__, "routed_experts": short})


def test_hf_engine_records_the_routes_its_layers_used(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_rl.rollout.backends.hf import HFBackend
    from megatron_rl.rollout.settings import DeviceAssignment
    from megatron_rl.rollout.types import GenerationRequest, SamplingSettings
    from megatron_rl.rollout.worker import WorkerSpec

    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe")
    spec = WorkerSpec(
        index=0, backend="hf", model_path=str(path), device=DeviceAssignment(kind="cpu"), return_routed_experts=True
    )
    engine = HFBackend(spec)
    prompts = [(3, 4, 5, 6, 7), (9, 8), (11, 12, 13)]  # uneven: left padding in the batch
    requests = [
        GenerationRequest(request_id=str(i), prompt_ids=p, sampling=SamplingSettings(max_new_tokens=4 + i, seed=i))
        for i, p in enumerate(prompts)
    ]
    results = {r.request_id: r for r in engine.generate(requests, weight_version=0)}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for r in results.values():
        ids = torch.tensor([r.prompt_ids + r.response_ids[:-1]])
        with torch.no_grad():
            logits = model(input_ids=ids, output_router_logits=True).router_logits  # per MoE layer [T, E]
        moe_layers = [i for i in range(LAYERS) if i != 1]
        got = r.routed_experts.indices
        assert got.shape == (ids.shape[1], LAYERS, TOP_K)
        for layer, lg in zip(moe_layers, logits, strict=True):
            want = torch.softmax(lg.float(), -1).topk(TOP_K, dim=-1).indices.sort(-1).values
            assert torch.equal(torch.from_numpy(np.sort(got[:, layer], -1)).long(), want), (r.request_id, layer)


def test_config_refuses_replay_without_moe_or_without_route_output(tmp_path):
    from megatron_rl.config import ConfigError, load_config
    from tests.test_config import MINIMAL, SMOLLM2

    moe = {**SMOLLM2, "model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2}
    path = tmp_path / "c.yaml"
    path.write_text(MINIMAL)
    replay = ["algorithm.routing_replay=rollout"]
    assert load_config(path, replay, hf_config=moe).algorithm.routing_replay == "rollout"  # hf engine on CPU
    assert load_config(path, [*replay, "rollout.engine=vllm", "rollout.devices=[cuda:0]"], hf_config=moe)
    cases = [
        (SMOLLM2, [], "is a dense model"),
        (moe, ["rollout.engine=vllm"], "vLLM on CPU"),
        (moe, ["algorithm.routing_replay=always"], "algorithm.routing_replay"),
    ]
    for hf, extra, words in cases:
        with pytest.raises(ConfigError, match=words) as info:
            load_config(path, [*replay, *extra], hf_config=hf)
        assert "algorithm.routing_replay" in str(info.value)


def test_routes_survive_dp_shipping_and_the_vllm_output():
    import pickle
    from types import SimpleNamespace

    from megatron_rl.rollout.backends.vllm import _result
    from megatron_rl.rollout.types import GenerationRequest, SamplingSettings
    from megatron_rl.trainer.replica import shipped

    rng = np.random.default_rng(2)
    group = _group([_sample(k, (4, 5, 6), n, rng) for k, n in enumerate((2, 4))])
    mb = make_micro_batch([group], policy_version=0, replica=1)
    sent = pickle.loads(pickle.dumps(shipped(mb)))  # what DispatchChannel sends another replica
    assert sent.groups == () and torch.equal(sent.packed.routed_experts, _expected(group.samples))
    # vLLM's CompletionOutput.routed_experts [prompt + response - 1, layers, top_k] -> GenerationResult
    routes = rng.integers(0, EXPERTS, (3 + 2 - 1, LAYERS, TOP_K))
    completion = SimpleNamespace(
        token_ids=[7, 8],
        logprobs=[{7: SimpleNamespace(logprob=-1.0)}, {8: SimpleNamespace(logprob=-2.0)}],
        finish_reason="length",
        routed_experts=routes,
    )
    request = GenerationRequest(request_id="r", prompt_ids=(1, 2, 3), sampling=SamplingSettings())
    output = SimpleNamespace(outputs=[completion], num_cached_tokens=0)  # vLLM's RequestOutput
    assert _result(request, output, 0).routed_experts == RoutedExperts(routes)
