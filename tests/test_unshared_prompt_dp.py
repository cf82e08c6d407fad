"""``attention.shared_prompt: false`` at DP > 1.

A micro-batch for another DP replica travels without its ``groups`` (``replica.shipped``), and
the K-copies layout was rebuilt from those groups on the receiving rank, so replica 1 raised in
``concat_groups([])`` at its first micro-batch. Rank 0 (the dispatcher, which holds the groups)
now converts once, before a micro-batch is trained or sent anywhere.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.attention.packing import concat_groups, k_copies, pack_group
from megatron_rl.pipeline.records import Sample, make_micro_batch, to_token_group
from megatron_rl.pipeline.scoring import GroupScoring, score_group
from tests.distributed import run_distributed
from tests.rl_fixtures import load_weights, make_tiny_rl_model, tiny_rl_config, train_run

TOL = 1e-5


def _sample(k: int, response: tuple[int, ...], reward: float, prompt: tuple[int, ...]) -> Sample:
    return Sample(
        prompt_id="p",
        request_id=f"0/p/{k}",
        index=k,
        prompt_ids=prompt,
        response_ids=response,
        behav_logprobs=(-0.5,) * len(response),
        weight_version=0,
        finish_reason="stop",
        reward=reward,
    )


def _micro_batch(replica: int):
    g1 = score_group(
        step=0,
        prompt_index=0,
        samples=[_sample(0, (7, 8), 1.0, (1, 2, 3)), _sample(1, (9,), 0.0, (1, 2, 3))],
        scoring=GroupScoring(),
    )
    g2 = score_group(
        step=0,
        prompt_index=1,
        samples=[_sample(0, (6, 6, 6), 0.0, (2,)), _sample(1, (5,), 1.0, (2,))],
        scoring=GroupScoring(),
    )
    return make_micro_batch([g1, g2], policy_version=0, replica=replica), [g1, g2]


class _Recorder:
    """Stands in for a ``PolicyTrainer`` (what it was asked to train) and a ``DispatchChannel``."""

    def __init__(self, shared_prompt: bool) -> None:
        self.shared_prompt, self.trained, self.sent = shared_prompt, [], []
        self.trimodel = SimpleNamespace(stage=SimpleNamespace(routing_replay=False))

    def train_micro_batch(self, mb) -> None:
        self.trained.append(mb)

    def send(self, replica: int, message) -> None:
        self.sent.append((replica, message))


def _leader(shared_prompt: bool):
    from megatron_rl.trainer.replica import LeaderReplica

    rec = _Recorder(shared_prompt)
    replica = SimpleNamespace(
        trainer=rec, channel=SimpleNamespace(send=lambda _m: None), dispatch=rec, probe=None, seconds={"train": 0.0}
    )
    return LeaderReplica(replica), rec


@pytest.mark.parametrize("target", [0, 1])
def test_every_replica_trains_the_k_copies_layout(target):
    """The micro-batch replica ``target`` trains is in the K-copies layout (each response after its
    own prompt copy, packed here independently with ``k_copies``), whether rank 0 trains it or it
    is shipped without its groups; before the fix replica 1 got the shared layout and no groups."""
    leader, rec = _leader(shared_prompt=False)
    mb, groups = _micro_batch(target)
    leader.train_micro_batch(mb)
    if target == 0:
        (got,) = rec.trained
    else:
        ((replica, (name, (got,))),) = rec.sent
        assert (replica, name, got.groups) == (1, "train_micro_batch", ())
    want = concat_groups([pack_group(g) for g in k_copies([to_token_group(g) for g in groups])])
    assert got.packed.token_ids.tolist() == [1, 2, 3, 7, 8, 1, 2, 3, 9, 2, 6, 6, 6, 2, 5]
    for field in ("token_ids", "position_ids", "segment_ids", "group_ids", "logit_index", "target_ids"):
        assert torch.equal(getattr(got.packed, field), getattr(want, field)), field
    assert got.packed.response_lens == want.response_lens
    for field in ("advantages", "behav_logprobs", "versions"):
        assert torch.equal(getattr(got, field), getattr(mb, field))
    assert got.packed.layout.groups == want.layout.groups  # one plain causal sequence per response


def test_shared_prompt_micro_batches_go_out_unchanged():
    leader, rec = _leader(shared_prompt=True)
    mb, _ = _micro_batch(1)
    leader.train_micro_batch(mb)
    ((_, (_, (got,))),) = rec.sent
    assert got.packed is mb.packed


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unshared_dp")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        data={"max_prompt_tokens": 128},
        rollout={"max_batch_size": 4},
        trainer={"steps": 2, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
    )
    return tmp, str(config)


def _run(tmp, config, name: str, world: int, shared: str) -> dict:
    out = tmp / name
    overrides = [
        "pipeline.mode=sync",
        f"attention.shared_prompt={shared}",
        "trainer.save_every=1",
        f"trainer.save_dir={out}",
    ]
    run_distributed(train_run, world, config, overrides, timeout_s=600)
    return load_weights(out / "step_2" / "model")


@pytest.mark.slow
@pytest.mark.multiproc
def test_dp2_unshared_prompt_run_equals_the_dp1_run(setup):
    """DP 2 with ``attention.shared_prompt=false`` ends 2 steps on the DP 1 run's weights (same
    batches, split over the replicas by tokens); before the fix its replica 1 raised in
    ``concat_groups([])`` at its first micro-batch."""
    tmp, config = setup
    reference = _run(tmp, config, "dp1", 1, "false")
    dp2 = _run(tmp, config, "dp2", 2, "false")
    initial = load_weights(tmp / "model")
    moved = max((reference[k] - initial[k]).abs().max().item() for k in reference)
    diff = max((dp2[k] - reference[k]).abs().max().item() for k in reference)
    print(f"max |weight diff| DP 2 vs DP 1 (shared_prompt=false): {diff:.2e}, training moved them by {moved:.2e}")
    assert moved > 1e-3, "training did not move the weights"
    assert diff <= TOL, f"DP 2 weights differ from DP 1 by {diff:.2e}"
