"""Tri-model: one schedule's three log-probs equal three separate passes; grads reach only the policy.

Subject: three DIFFERENT random checkpoints loaded into policy / old / ref of one
``TriModel``, one ``run`` (one pipeline schedule) over two packed micro-batches.
Reference: three independently built models, each run through ``run_schedule`` on its own
with a forward step written out here. Checked at TP=2 and PP=2 (gloo): log-probs of all
three (fp32, <= 1e-5), policy gradients (<= 1e-4 relative), no gradient on old / ref; then
the skip path (policy only, old = detached policy, no ref) and ``refresh_old``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.correction import RolloutCorrection
from megatron_rl.algorithms.losses import LossSettings
from megatron_rl.trimodel.offload import HostOffload
from megatron_rl.trimodel.plan import Residency, plan_trimodel
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rl_fixtures import TRAIN_PLATFORM

GROUPS = [(7, (3, 1, 5)), (4, (1,)), (9, (6, 2, 2, 4))]  # (prompt len, response lens)
TOKEN_BUDGET = 23  # two micro-batches: groups 0+1, then group 2


def _micro_batches(vocab: int):
    from megatron_rl.attention.packing import TokenGroup, pack_groups

    g = torch.Generator().manual_seed(3)
    groups = [
        TokenGroup(
            prompt_ids=torch.randint(0, vocab, (lp,), generator=g),
            response_ids=tuple(torch.randint(0, vocab, (n,), generator=g) for n in lens),
        )
        for lp, lens in GROUPS
    ]
    mbs = pack_groups(groups, token_budget=TOKEN_BUDGET)
    assert len(mbs) == 2
    weights = [torch.randn(mb.target_ids.numel(), generator=g) for mb in mbs]
    return mbs, weights


def _separate(model, mbs, weights, vocab, *, forward_only):
    """One model through its own schedule: weighted-sum loss, response log-probs returned."""
    from megatron_rl.attention.context import packed_attention
    from megatron_rl.parallel.schedule import run_schedule
    from megatron_rl.parallel.vocab_parallel import vocab_parallel_logprobs

    def forward_step(m, item):
        with packed_attention(item[1].layout):
            return m(item[1].token_ids[None], item[1].position_ids[None], attention_mask=None)

    def loss(logits, item):
        i, mb = item
        lp = vocab_parallel_logprobs(logits[0, mb.logit_index], mb.target_ids, vocab_size=vocab)
        return (lp * weights[i]).sum(), lp.detach()

    device = next(model.parameters()).device
    mbs, weights = [mb.to(device) for mb in mbs], [w.to(device) for w in weights]

    out = run_schedule(
        model,
        list(enumerate(mbs)),
        forward_step=forward_step,
        loss=loss,
        seq_length=lambda item: item[1].num_tokens,
        forward_only=forward_only,
    )
    return torch.cat(out) if out else torch.empty(0)


def _worker(tp, pp, paths, offload):
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.trimodel import LogprobSettings, TriModel

    plat, _ = initialize_parallel(tp=tp, pp=pp, platform=TRAIN_PLATFORM)  # offload: host <-> a device
    load = lambda p: load_model_from_hf(p, attention_backend="split")  # noqa: E731
    (policy, spec), (old, _), (ref, _) = (load(p) for p in paths)
    vocab = spec.vocab_size
    mbs, weights = _micro_batches(vocab)
    weights = [w.to(plat.device) for w in weights]
    plan = plan_trimodel(
        LossSettings(kl_coef=0.1), optimizer_steps_per_batch=2, offload_old=offload, offload_ref=offload
    )
    tri = TriModel(policy=policy, old=old, ref=ref, plan=plan, logprobs=LogprobSettings(vocab_size=vocab))

    def loss(lp, i):  # old / ref enter the loss too: no graph may lead from them to parameters
        w = weights[i]
        return (lp.policy * w).sum() + (lp.old * w).sum() + (lp.ref * w).sum(), (lp.policy.detach(), lp.old, lp.ref)

    fused = tri.run(mbs, loss=loss)
    fused = [torch.cat([p[k] for p in fused]) if fused else torch.empty(0) for k in range(3)]
    sep_models = [load(p)[0] for p in paths]
    separate = [_separate(m, mbs, weights, vocab, forward_only=k > 0) for k, m in enumerate(sep_models)]
    grads = {
        n: (p.grad.clone(), q.grad.clone())
        for (n, p), (_, q) in zip(policy.named_parameters(), sep_models[0].named_parameters(), strict=True)
    }
    frozen_grads = [p.grad for m in (old, ref) for p in m.parameters()]
    memory = tri.memory_report()

    # Skip path: policy only (one stream between stages); old is the detached policy, ref is None.
    skip_plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1)
    solo = TriModel(
        policy=sep_models[0], old=None, ref=None, plan=skip_plan, logprobs=LogprobSettings(vocab_size=vocab)
    )
    skipped = solo.run(
        mbs, loss=lambda lp, i: (lp.policy.sum(), (lp.policy, lp.old, lp.ref, lp.old_is_policy)), forward_only=True
    )
    # refresh_old: the old copy now holds the policy's weights.
    assert tri.refresh_old()
    refreshed = tri.run(mbs, loss=lambda lp, i: (lp.policy.sum(), lp.old), forward_only=True)
    refreshed = torch.cat(refreshed) if refreshed else torch.empty(0)
    return _on_host(
        dict(
            fused=fused,
            separate=separate,
            grads=grads,
            frozen_grads=frozen_grads,
            memory=memory,
            skipped=skipped,
            refreshed=refreshed,
            old_bytes=sum(p.numel() * 4 for p in old.parameters()),
        )
    )


def _on_host(value):
    """``value`` with every tensor copied to the host (the test process has no device)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_host(v) for v in value)
    return value


def _check(results, offload):
    n_tokens = sum(sum(lens) for _, lens in GROUPS)
    assert any(r["fused"][0].numel() for r in results), "no rank returned log-probs"
    for rank, r in enumerate(results):
        if r["fused"][0].numel():
            for name, got, want in zip(("policy", "old", "ref"), r["fused"], r["separate"], strict=True):
                assert got.shape == (n_tokens,)
                assert (got - want).abs().max() <= 1e-5, f"rank {rank} {name} log-probs"
            assert (r["fused"][1] - r["fused"][0]).abs().max() > 1e-3, "old checkpoint should differ from policy"
            for lp, old, ref, old_is_policy in r["skipped"]:
                assert old_is_policy and ref is None and not old.requires_grad
                assert torch.equal(old, lp)
            assert (torch.cat([s[0] for s in r["skipped"]]) - r["separate"][0]).abs().max() <= 1e-5
            assert (r["refreshed"] - r["separate"][0]).abs().max() <= 1e-5, f"rank {rank} old after refresh"
        assert r["grads"], "no parameters"
        for name, (g, ref) in r["grads"].items():
            rel = (g - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
            assert rel <= 1e-4, f"rank {rank} {name}: relative grad error {rel:.2e}"
        assert r["frozen_grads"] and all(g is None for g in r["frozen_grads"]), f"rank {rank}: old/ref got grads"
        mem = r["memory"]
        where = "host_bytes" if offload else "device_bytes"
        assert getattr(mem.old, where) == r["old_bytes"] > 0 and getattr(mem.ref, where) > 0
        assert mem.policy.device_bytes == r["old_bytes"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return [str(make_tiny_hf(root / f"qwen3_{s}", "qwen3", seed=s, layers=2)) for s in range(3)]


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp,offload", [(2, 1, False), (1, 2, True)])
def test_trimodel_equals_three_separate_passes(checkpoints, tp, pp, offload):
    _check(run_distributed(_worker, tp * pp, tp, pp, checkpoints, offload), offload)


@pytest.mark.parametrize(
    "settings,steps,old,ref",
    [
        (LossSettings(), 1, Residency.SKIPPED, Residency.SKIPPED),
        (LossSettings(kl_coef=0.05), 4, Residency.RESIDENT, Residency.RESIDENT),
        (LossSettings(kind="ppo_decoupled", proximal="loglinear"), 4, Residency.SKIPPED, Residency.SKIPPED),
        # a rollout correction compares the engine with θ_t on every mini-batch: A-3PO keeps the old copy for it
        (
            LossSettings(
                kind="ppo_decoupled", proximal="loglinear", correction=RolloutCorrection(mode="token_mask", c_max=2.0)
            ),
            4,
            Residency.RESIDENT,
            Residency.SKIPPED,
        ),
        (
            LossSettings(
                kind="ppo_decoupled", proximal="loglinear", correction=RolloutCorrection(mode="token_mask", c_max=2.0)
            ),
            1,
            Residency.SKIPPED,
            Residency.SKIPPED,
        ),
        (LossSettings(kind="ppo_decoupled", proximal="recompute"), 2, Residency.RESIDENT, Residency.SKIPPED),
    ],
)
def test_plan_skips_copies_that_cannot_matter(settings, steps, old, ref):
    plan = plan_trimodel(settings, optimizer_steps_per_batch=steps)
    assert (plan.old.residency, plan.ref.residency) == (old, ref)
    kept = {"old": old, "ref": ref}
    assert plan.active == ("policy",) + tuple(n for n in ("old", "ref") if kept[n] is Residency.RESIDENT)
    assert all(r.split(":")[0].split()[1] in ("resident", "skipped", "offloaded") for r in plan.reasons)


def test_plan_reasons_and_offload_flags():
    plan = plan_trimodel(LossSettings(kl_coef=0.1), optimizer_steps_per_batch=1, offload_ref=True, offload_old=True)
    assert plan.old.residency is Residency.SKIPPED and "1 optimizer step" in plan.old.reason
    assert plan.ref.residency is Residency.OFFLOADED and "offload_reference" in plan.ref.reason
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=3, offload_old=True)
    assert plan.old.residency is Residency.OFFLOADED and plan.ref.reason.startswith("ref skipped: kl_coef = 0")
    with pytest.raises(ValueError, match="optimizer_steps_per_batch"):
        plan_trimodel(LossSettings(), optimizer_steps_per_batch=0)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_host_offload_bookkeeping(device):
    """Parameters keep identity and values through onload/release; real moves only off the host."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).requires_grad_(False)
    before = [p.clone() for p in module.parameters()]
    params = list(module.parameters())
    offload = HostOffload(module, device=torch.device(device))
    assert offload.nbytes == sum(p.numel() * 4 for p in before)
    assert all(p.device.type == "cpu" for p in module.parameters())
    for _ in range(2):
        offload.onload()
        assert offload.on_device and all(p.device.type == device for p in module.parameters())
        assert list(module.parameters()) == params  # same Parameter objects, new storage
        offload.release()
        assert not offload.on_device
        restored = zip(module.parameters(), before, strict=True)
        assert all(p.device.type == "cpu" and torch.equal(p, b) for p, b in restored)
    assert offload.bytes_onloaded == (0 if device == "cpu" else 2 * offload.nbytes)
