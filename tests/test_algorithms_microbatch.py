"""Micro-batch and data-parallel invariance of the loss aggregation.

A tiny module produces logits; the gradient of the whole batch must equal the sum of the
gradients of its micro-batches (1, 2, 4 and uneven splits), and of two gloo DP ranks
(all-reduced SUM), when every micro-batch divides by the batch denominator.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rl.algorithms import LossSettings, loss_denominator, policy_loss
from tests.distributed import free_port

B, L, V, H = 8, 6, 11, 8
LENGTHS = [6, 1, 4, 5, 2, 6, 3, 5]
CURRENT_VERSION = 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Tanh(), torch.nn.Linear(H, V))


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g)
    targets = torch.randint(0, V, (B, L), generator=g)
    with torch.no_grad():
        logp0, _ = _logp_and_entropy(_model(), ids, targets)
    return dict(
        ids=ids,
        targets=targets,
        old=logp0 + 0.3 * torch.randn(B, L, generator=g),
        ref=logp0 + 0.3 * torch.randn(B, L, generator=g),
        behav=logp0 + 0.3 * torch.randn(B, L, generator=g),
        versions=torch.randint(1, CURRENT_VERSION + 1, (B, L), generator=g),
        mask=torch.tensor([[1.0] * n + [0.0] * (L - n) for n in LENGTHS]),
        adv=torch.randn(B, generator=g),
    )


def _logp_and_entropy(model, ids, targets):
    logprobs = torch.log_softmax(model(ids), dim=-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy


SETTINGS = {
    "grpo": LossSettings(kind="grpo", kl_coef=0.05, entropy_coef=0.01),
    "bnpo": LossSettings(kind="bnpo", kl_coef=0.05, kl_estimator="k2"),
    "dapo": LossSettings(kind="dapo", clip_high=0.28, entropy_coef=0.01),
    "dr_grpo": LossSettings(kind="dr_grpo", max_response_len=L, kl_coef=0.05),
    "a3po": LossSettings(kind="ppo_decoupled", proximal="loglinear", behav_weight_cap=1.15),
}


def _microbatch_loss(model, s, batch, rows, denominator):
    logp, entropy = _logp_and_entropy(model, batch["ids"][rows], batch["targets"][rows])
    return policy_loss(
        s,
        logp=logp,
        mask=batch["mask"][rows],
        advantages=batch["adv"][rows],
        denominator=denominator,
        old_logp=batch["old"][rows],
        ref_logp=batch["ref"][rows],
        behav_logp=batch["behav"][rows],
        versions=batch["versions"][rows],
        current_version=CURRENT_VERSION,
        entropy=entropy,
    ).loss


def _grads(s, batch, microbatches, denominator=None):
    """Accumulated grads over ``microbatches`` (lists of row indices), flattened."""
    model = _model()
    if denominator is None:  # additive shares, summed over the batch's micro-batches
        denominator = sum(loss_denominator(s, batch["mask"][rows]) for rows in microbatches)
    for rows in microbatches:
        _microbatch_loss(model, s, batch, rows, denominator).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


SPLITS = {
    1: [list(range(8))],
    2: [list(range(0, 4)), list(range(4, 8))],
    4: [[0, 1], [2, 3], [4, 5], [6, 7]],
    "uneven": [[0], [1, 2, 3], [4, 5, 6, 7]],
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_microbatch_split_gives_same_grad(name):
    s, batch = SETTINGS[name], _batch()
    whole = _grads(s, batch, SPLITS[1])
    assert whole.norm() > 0
    for split in (2, 4, "uneven"):
        assert _rel(_grads(s, batch, SPLITS[split]), whole) <= 1e-5, (name, split)


def test_mean_of_microbatch_means_would_differ():
    # Negative control: per-micro-batch token means averaged are not the batch token mean,
    # so the invariance test above can fail.
    s, batch = SETTINGS["bnpo"], _batch()
    whole = _grads(s, batch, SPLITS[1])
    model = _model()
    for rows in SPLITS[4]:
        local = loss_denominator(s, batch["mask"][rows]) * len(SPLITS[4])
        _microbatch_loss(model, s, batch, rows, local).backward()
    naive = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _rel(naive, whole) > 1e-3


def _dp_worker(rank, world, port, names):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        batch = _batch()
        # rank 0 runs two micro-batches, rank 1 one: DP ranks need not match in count
        mine = [[0, 1], [2, 3]] if rank == 0 else [[4, 5, 6, 7]]
        for name in names:
            s = SETTINGS[name]
            den = sum(loss_denominator(s, batch["mask"][rows]) for rows in mine)
            dist.all_reduce(den)  # before the first backward
            grad = _grads(s, batch, mine, denominator=den)
            dist.all_reduce(grad)
            rel = _rel(grad, _grads(s, batch, SPLITS[1]))
            assert rel <= 1e-5, f"rank {rank} {name}: relative grad error {rel:.2e}"
    finally:
        dist.destroy_process_group()


def test_two_dp_ranks_allreduced_grad_equals_single_process():
    mp.spawn(_dp_worker, args=(2, free_port(), list(SETTINGS)), nprocs=2, join=True)
