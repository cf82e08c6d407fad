"""Routing replay in the trainer: the engine's routes are the routes the trainer's routers use, exactly.

Engine side: the ``hf`` engine (bf16) samples a group from a tiny Qwen3-MoE (layer 1 dense)
whose routers carry planted noise, recording each token's experts. Trainer side: a ``TriModel``
(policy = the clean checkpoint, old and ref = two other random MoEs) on two gloo ranks, one
forward + backward over the packed group. Observed independently of the replay code: a forward
hook on every megatron ``TopKRouter`` reads the ``routing_map`` the token dispatcher used.
Layouts: PP = 2 (the stages hold different MoE layers) and DP = 2 × EP = 2 (each rank routes its
own tokens before the all-to-all sends them to the rank that holds the expert).
With replay, the policy's and the old copy's experts equal the engine's on every forwarded
token of every MoE layer of both stages; the reference routes itself (the same as without
replay); without replay the policy's routes differ from the engine's (the check can fail).
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_moe_models import make_tiny_moe
from tests.rl_fixtures import TRAIN_PLATFORM

pytestmark = [pytest.mark.multiproc]


def _engine_group(clean, noisy_dir):
    """One ``ScoredGroup`` (prompt, 3 responses) sampled by a bf16 hf engine from ``noisy_dir``."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.pipeline.records import Sample, ScoredGroup
    from megatron_rl.rollout.backends.hf import HFBackend
    from megatron_rl.rollout.settings import DeviceAssignment
    from megatron_rl.rollout.types import GenerationRequest, SamplingSettings
    from megatron_rl.rollout.worker import WorkerSpec

    hf = AutoModelForCausalLM.from_pretrained(clean, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.1 * p.std() * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    hf.save_pretrained(noisy_dir)
    engine = HFBackend(
        WorkerSpec(
            index=0,
            backend="hf",
            model_path=str(noisy_dir),
            dtype="bfloat16",
            device=DeviceAssignment(kind="cpu"),
            return_routed_experts=True,
        )
    )
    prompt = tuple(range(5, 17))
    requests = [
        GenerationRequest(
            request_id=f"0/p/{k}", prompt_ids=prompt, sampling=SamplingSettings(max_new_tokens=12, seed=k)
        )
        for k in range(3)
    ]
    results = sorted(engine.generate(requests, weight_version=0), key=lambda r: r.request_id)
    samples = tuple(
        Sample(
            prompt_id="p",
            request_id=r.request_id,
            index=k,
            prompt_ids=r.prompt_ids,
            response_ids=r.response_ids,
            behav_logprobs=r.logprobs,
            weight_version=0,
            finish_reason=r.finish_reason,
            reward=float(k),
            routed_experts=r.routed_experts,
        )
        for k, r in enumerate(results)
    )
    return ScoredGroup(
        step=0,
        prompt_index=0,
        prompt_id="p",
        samples=samples,
        rewards=torch.zeros(3),
        advantages=torch.zeros(3),
        kept=True,
    )


def _replay_worker(layout, paths, group):
    from megatron_rl.algorithms.losses import LossSettings
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trimodel import LogprobSettings, TriModel, plan_trimodel
    from megatron_rl.trimodel.routing import RouteCapture, moe_routers

    initialize_parallel(**layout, platform=TRAIN_PLATFORM)
    policy, old, ref = (load_model_from_hf(p, attention_backend="split")[0] for p in paths)
    mb = make_micro_batch([group], policy_version=0).packed
    plan = plan_trimodel(LossSettings(kl_coef=0.1), optimizer_steps_per_batch=2, offload_old=False, offload_ref=False)
    out = {"layers": [r.layer_number for r in moe_routers(policy)]}
    for replay in (True, False):
        tri = TriModel(
            policy=policy, old=old, ref=ref, plan=plan, logprobs=LogprobSettings(vocab_size=300, routing_replay=replay)
        )
        captures = {name: RouteCapture(m) for name, m in (("policy", policy), ("old", old), ("ref", ref))}
        tri.run([mb], loss=lambda lp, i: (lp.policy.sum(), None))
        out[replay] = {name: c.routes() for name, c in captures.items()}
        for c in captures.values():
            c.close()
    return out


def _forwarded(group) -> torch.Tensor:
    """Packed positions the engine forwarded: all but each response's (sampled-only) last token."""
    lp, keep = len(group.samples[0].prompt_ids), [True] * len(group.samples[0].prompt_ids)
    for s in group.samples:
        keep += [True] * (len(s.response_ids) - 1) + [False]
    assert len(keep) == lp + sum(len(s.response_ids) for s in group.samples)
    return torch.tensor(keep)


@pytest.mark.parametrize("layout", [dict(tp=1, pp=2), dict(tp=1, pp=1, ep=2)], ids=["pp2", "dp2-ep2"])
def test_replay_makes_the_trainers_routes_the_engines(layout, tmp_path):
    from megatron_rl.attention.packing import pack_group
    from megatron_rl.pipeline.records import to_token_group

    paths = [make_tiny_moe(tmp_path / f"m{seed}", "qwen3_moe", seed=seed) for seed in (0, 1, 2)]
    group = _engine_group(paths[0], tmp_path / "engine")
    engine = pack_group(to_token_group(group)).routed_experts.long()  # [T, layers, K], packed order
    keep = _forwarded(group)
    layers_seen = []
    for out in run_distributed(_replay_worker, 2, layout, paths, group):
        layers_seen += out["layers"]
        want = torch.stack([engine[:, n - 1].sort(-1).values for n in out["layers"]], dim=1)[keep]
        assert torch.equal(out[True]["policy"][keep], want)
        assert torch.equal(out[True]["old"][keep], want)
        assert torch.equal(out[True]["ref"], out[False]["ref"])  # the reference routes itself, replay or not
        assert not torch.equal(out[True]["ref"][keep], want)
        assert not torch.equal(out[False]["policy"][keep], want)  # without replay some experts differ
    # every MoE layer (layer 2 is dense): split over the two stages at pp 2, on both EP ranks at ep 2
    assert sorted(layers_seen) == ([1, 3, 4] if layout["pp"] == 2 else [1, 1, 3, 3, 4, 4])


def _recompute_worker(paths, group):
    """The policy with full activation recompute: every router call, the forward's and the one
    recompute makes inside backward, recorded by its own hook with the layer it belongs to."""
    from megatron_rl.algorithms.losses import LossSettings
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.pipeline.records import make_micro_batch
    from megatron_rl.trimodel import LogprobSettings, TriModel, plan_trimodel
    from megatron_rl.trimodel.routing import moe_routers

    initialize_parallel(tp=1, pp=1, platform=TRAIN_PLATFORM)
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    policy = load_model_from_hf(paths[0], attention_backend="split", megatron_overrides=recompute)[0]
    calls = []
    for router in moe_routers(policy):

        def hook(module, args, output, n=router.layer_number):
            routing_map = output[1]
            calls.append((n, routing_map.nonzero()[:, 1].reshape(-1, module.topk).detach().cpu()))

        router.register_forward_hook(hook)
    mb = make_micro_batch([group], policy_version=0).packed
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1, offload_old=False, offload_ref=False)
    tri = TriModel(
        policy=policy, old=None, ref=None, plan=plan, logprobs=LogprobSettings(vocab_size=300, routing_replay=True)
    )
    tri.run([mb], loss=lambda lp, i: (lp.policy.sum(), None))
    grads = sum(int(p.grad is not None or getattr(p, "main_grad", None) is not None) for p in policy.parameters())
    return calls, grads


def test_replay_holds_under_activation_recompute(tmp_path):
    """Recompute re-runs each router inside backward; it must take the engine's routes again."""
    from megatron_rl.attention.packing import pack_group
    from megatron_rl.pipeline.records import to_token_group

    path = make_tiny_moe(tmp_path / "m0", "qwen3_moe", seed=0)
    group = _engine_group(path, tmp_path / "engine")
    engine = pack_group(to_token_group(group)).routed_experts.long()
    keep = _forwarded(group)
    ((calls, grads),) = run_distributed(_recompute_worker, 1, [path], group)
    assert grads > 0
    per_layer = {}
    for n, routes in calls:
        per_layer[n] = per_layer.get(n, 0) + 1
        assert torch.equal(routes.sort(-1).values[keep], engine[:, n - 1].sort(-1).values[keep]), f"layer {n}"
    assert per_layer and all(count == 2 for count in per_layer.values()), per_layer  # forward + recompute
