"""A mixture-of-experts policy under context parallelism, with expert parallelism over the CP ranks.

Subject: a tiny Qwen3-MoE (2 layers, layer 0 sparse: 4 experts, top 2) on the emulated NPU,
``TriModel`` in megatron's DDP, both router losses on (aux or seq_aux load balancing + z-loss,
more than 1 % of the router's gradient), one shared-prompt micro-batch of ragged segments, so
the two CP ranks hold unequal token counts (the per-segment zigzag does not pad). Layouts in one
world of 2: CP 2 × EP 1, and CP 2 × EP 2 (megatron carves the expert groups out of DP × CP: each
CP rank holds 2 experts and the all-to-all sends its tokens to the other's), the latter also with
full activation recompute, with routing replay (random top-2 "engine" routes for every packed
token, ``[T, L, K]``: each CP rank must take its own tokens' rows) and with both. Reference,
computed independently of CP and EP: the same model in a world of 1 (CP 1, EP 1, the same routes
replayed or none), every gradient after megatron's reduction (rel 1e-5 of the tensor's largest
entry; a local expert ``i`` of EP rank ``r`` is expert ``2r + i``), the log-probs (1e-5).
Without ``platform/patches/moe_cp_router_losses`` the gradients are off by 5e-4 to 5e-3 (rel;
megatron assumes equal slices); the replayed log-probs differ from the self-routed ones by > 1e-2.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_moe_models import make_tiny_moe
from tests.rl_fixtures import TRAIN_PLATFORM

GROUPS = [(7, (3, 1, 5)), (4, (1,)), (9, (6, 2, 2, 4))]  # (prompt length, response lengths)
AUX, Z = 0.2, 0.05
BALANCING = ("aux_loss", "seq_aux_loss")
EXPERTS, TOP_K, LAYERS = 4, 2, 2
# full recompute: the routers, their losses' collectives and the all-to-all re-run in backward
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@dataclass(frozen=True)
class Case:
    """One run: the layout, recompute, routing replay (the engine's routes forced on the routers)
    and the router-loss settings; ``rank`` is the CP rank that returned it."""

    cp: int
    ep: int
    recompute: bool = False
    replay: bool = False
    balancing: str = "aux_loss"
    aux: float = AUX
    z: float = Z
    rank: int = 0


def _micro_batch(vocab: int, replay: bool):
    """The ragged shared-prompt micro-batch; with ``replay`` random top-2 "engine" routes for
    every packed token and layer (``[T, L, K]``, packed order)."""
    from megatron_rl.attention.packing import TokenGroup, pack_groups

    g = torch.Generator().manual_seed(3)
    groups = [
        TokenGroup(
            prompt_ids=torch.randint(0, vocab, (lp,), generator=g),
            response_ids=tuple(torch.randint(0, vocab, (n,), generator=g) for n in lens),
        )
        for lp, lens in GROUPS
    ]
    (mb,) = pack_groups(groups, token_budget=10_000)
    if not replay:
        return mb
    routes = torch.rand(mb.num_tokens, LAYERS, EXPERTS, generator=g).argsort(-1)[..., :TOP_K]
    return dataclasses.replace(mb, routed_experts=routes.to(torch.int16))


def _global_name(name: str, ep_rank: int, per_rank: int) -> str:
    """A local expert's parameter name -> the name of the same expert at EP 1."""
    return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{ep_rank * per_rank + int(m[1])}.", name)


def _run(path, case: Case):
    """(log-probs [N], {global name: reduced gradient}) of one forward + backward."""
    from megatron.core import parallel_state as ps

    from megatron_rl.algorithms import LossSettings
    from megatron_rl.config.schema import TrainerConfig
    from megatron_rl.models import load_model_from_hf
    from megatron_rl.models.moe import moe_loss_kwargs
    from megatron_rl.trainer.optim import wrap_for_training
    from megatron_rl.trimodel import LogprobSettings, TriModel
    from megatron_rl.trimodel.plan import plan_trimodel

    model, spec = load_model_from_hf(
        path,
        attention_backend="split",
        moe_losses=moe_loss_kwargs(case.balancing, case.aux, case.z),
        megatron_overrides=RECOMPUTE if case.recompute else None,
    )
    ddp, _ = wrap_for_training(model, TrainerConfig(steps=1))
    plan = plan_trimodel(LossSettings(), optimizer_steps_per_batch=1)
    settings = LogprobSettings(vocab_size=spec.vocab_size, routing_replay=case.replay)
    tri = TriModel(policy=ddp, old=None, ref=None, plan=plan, logprobs=settings)
    mb = _micro_batch(spec.vocab_size, case.replay)
    weights = torch.randn(mb.target_ids.numel(), generator=torch.Generator().manual_seed(11))

    def loss(lp, _i):
        return (lp.policy * weights.to(lp.policy.device)).sum(), lp.policy.detach().cpu()

    (logprobs,) = tri.run([mb], loss=loss)
    ep, rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    grads = {
        _global_name(n, rank, EXPERTS // ep): p.main_grad.detach().cpu().clone() for n, p in model.named_parameters()
    }
    return logprobs, grads


def _worker(path, cases):
    """Every case (grouped by layout) in this world; keyed by the case with this CP rank."""
    from megatron.core import parallel_state as ps

    from megatron_rl.parallel.state import destroy_parallel, initialize_parallel

    out = {}
    for layout in dict.fromkeys((c.cp, c.ep) for c in cases):
        initialize_parallel(tp=1, pp=1, cp=layout[0], ep=layout[1], platform=TRAIN_PLATFORM)
        for case in (c for c in cases if (c.cp, c.ep) == layout):
            out[dataclasses.replace(case, rank=ps.get_context_parallel_rank())] = _run(path, case)
        destroy_parallel(keep_world=True)
    return out


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


REFERENCE = [
    *(Case(1, 1, balancing=b, replay=r) for b in BALANCING for r in (False, True)),
    *(Case(1, 1, balancing=b, aux=0.0, z=0.0) for b in BALANCING),  # the router losses' weight
]
SUBJECTS = [
    *(Case(2, ep, balancing=b) for ep in (1, 2) for b in BALANCING),
    Case(2, 2, recompute=True),
    Case(2, 2, replay=True),
    Case(2, 2, recompute=True, replay=True),
]


def _check(case: Case, got, want) -> None:
    (lp, grads), (want_lp, want_grads) = got, want
    assert (lp - want_lp).abs().max() <= 1e-5, f"{case}: log-probs vs CP 1"
    assert grads and set(grads) <= set(want_grads), case
    if case.ep == 2:
        local = [n for n in grads if "local_experts" in n]
        assert 2 * len(local) == len([n for n in want_grads if "local_experts" in n]), case
    for name, g in grads.items():
        rel = _max_rel(g, want_grads[name])
        assert rel <= 1e-5, f"{case} {name}: relative grad error {rel:.2e} vs CP 1"


@pytest.mark.multiproc
def test_cp2_with_ep2_equals_cp1(tmp_path):
    """World 1 (6 runs) then world 2 (7 runs per rank): ~40 s on the 2-core machine."""
    path = str(make_tiny_moe(tmp_path / "moe", "qwen3_moe", layers=LAYERS, experts=EXPERTS))
    (ref,) = run_distributed(_worker, 1, path, REFERENCE, timeout_s=400)
    for b in BALANCING:
        want, plain = ref[Case(1, 1, balancing=b)][1], ref[Case(1, 1, balancing=b, aux=0.0, z=0.0)][1]
        router = [n for n in want if n.endswith("router.weight")]
        assert router and all(_max_rel(plain[n], want[n]) > 1e-2 for n in router), "router losses do not weigh in"
        replayed = ref[Case(1, 1, balancing=b, replay=True)][0]
        assert (replayed - ref[Case(1, 1, balancing=b)][0]).abs().max() > 1e-2, "the replayed routes change nothing"
    results = run_distributed(_worker, 2, path, SUBJECTS, timeout_s=400)
    assert [len(r) for r in results] == [len(SUBJECTS)] * 2
    for rank_out in results:
        for case, got in rank_out.items():
            want = ref[dataclasses.replace(case, cp=1, ep=1, recompute=False, rank=0)]
            _check(case, got, want)


def test_ep_takes_its_ranks_from_dp_times_cp():
    """check-config and the world rule accept EP (and routing replay) under CP when ep divides
    dp × cp (megatron's expert groups), and refuse it, naming parallel.ep, when it does not."""
    from megatron_rl.config import ConfigError, load_config, validate_world
    from megatron_rl.parallel.state import check_world

    recipe = "examples/recipes/qwen3-30b-a3b-910b/config.yaml"  # pp 3, ep 4, 128 experts
    cfg = load_config(recipe, ["parallel.cp=2"])
    assert (cfg.parallel.cp, cfg.parallel.ep, cfg.algorithm.routing_replay) == (2, 4, "rollout")
    assert validate_world(cfg, 12) == 2  # dp 2 × cp 2 = 4 ranks of each stage hold the 4 expert shards
    assert check_world(12, 1, 3, ep=4, cp=2) == 2 and check_world(2, 1, 1, ep=2, cp=2) == 1
    with pytest.raises(
        ConfigError, match=r"parallel\.ep \(4\) does not divide the data-parallel size 1 × parallel\.cp \(2\)"
    ) as info:
        validate_world(cfg, 6)
    assert info.value.keys == ("parallel.ep",)
    with pytest.raises(ValueError, match=r"parallel\.ep \(4\) does not divide dp x cp = 2"):
        check_world(6, 1, 3, ep=4, cp=2)
