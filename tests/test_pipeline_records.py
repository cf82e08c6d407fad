"""Pipeline bookkeeping without threads of its own: version schedule, the version clock, staleness
stats, request ids/seeds, group scoring and the one conversion to tensors."""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch

from megatron_rl.pipeline import (
    GroupScoring,
    OverlongShaping,
    PolicyVersions,
    Sample,
    VersionSchedule,
    make_micro_batch,
    request_id,
    request_seed,
    score_group,
    staleness_stats,
)


def test_schedule_on_policy_and_stale():
    periodic = VersionSchedule(mode="periodic", max_staleness=0, base_version=3)
    assert [periodic.required_version(i) for i in range(3)] == [3, 4, 5]
    assert [periodic.policy_version(i) for i in range(3)] == [3, 4, 5]
    stale = VersionSchedule(mode="stale", max_staleness=2, base_version=0)
    assert [stale.required_version(i) for i in range(4)] == [-2, -1, 0, 1]
    stale.check_sample(3, 1, "r")
    stale.check_sample(3, 3, "r")
    for bad in (0, 4):
        with pytest.raises(RuntimeError, match=r"allows \[1, 3\]"):
            stale.check_sample(3, bad, "r")
    with pytest.raises(RuntimeError, match="version 4"):
        periodic.check_sample(0, 4, "r")


@pytest.mark.parametrize(("mode", "k"), [("stale", 0), ("periodic", 1), ("sync", 2), ("async", 0), ("stale", 1.5)])
def test_schedule_rejects_bad_modes(mode, k):
    with pytest.raises(ValueError, match="pipeline.m"):
        VersionSchedule(mode=mode, max_staleness=k, base_version=0)


def test_policy_versions_wait_publish_and_stop():
    clock, stop = PolicyVersions(0), threading.Event()
    assert clock.wait_for(0, stop)
    seen = []
    waiter = threading.Thread(target=lambda: seen.append(clock.wait_for(2, stop, poll_s=1.0)))
    waiter.start()
    clock.publish(1)
    time.sleep(0.02)
    assert waiter.is_alive()
    clock.publish(2)
    waiter.join(2.0)
    assert seen == [True] and clock.current == 2
    with pytest.raises(ValueError, match="must be 3, got 5"):
        clock.publish(5)
    stopper = threading.Thread(target=lambda: seen.append(clock.wait_for(9, stop, poll_s=10.0)))
    stopper.start()
    stop.set()
    clock.wake()  # must return well before poll_s
    stopper.join(2.0)
    assert not stopper.is_alive() and seen == [True, False]


def test_staleness_stats():
    st = staleness_stats([4, 5, 5, 3], policy_version=5)
    assert (st.num_samples, st.min, st.max) == (4, 0, 2) and st.mean == pytest.approx(0.75)
    assert staleness_stats([], 5).num_samples == 0


def test_request_ids_and_seeds_are_unique_and_stable():
    keys = [(s, p, k) for s in range(3) for p in ("a", "b", "a/1") for k in range(4)]
    assert len({request_id(*key) for key in keys}) == len(keys)
    seeds = [request_seed(11, *key) for key in keys]
    assert len(set(seeds)) == len(keys) and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [request_seed(11, *key) for key in keys]
    assert request_seed(12, 0, "a", 0) != request_seed(11, 0, "a", 0)


def sample(k, response, reward, version=0, prompt=(1, 2, 3)):
    return Sample(
        prompt_id="p",
        request_id=f"0/p/{k}",
        index=k,
        prompt_ids=prompt,
        response_ids=response,
        behav_logprobs=tuple(-0.1 * (i + 1) for i in range(len(response))),
        weight_version=version,
        finish_reason="stop",
        reward=reward,
    )


def test_sample_validates_engine_output():
    with pytest.raises(ValueError, match="empty response"):
        sample(0, (), 1.0)
    with pytest.raises(ValueError, match="2 log-probs for 3"):
        Sample(
            prompt_id="p",
            request_id="r",
            index=0,
            prompt_ids=(1,),
            response_ids=(1, 2, 3),
            behav_logprobs=(0.0, 0.0),
            weight_version=0,
            finish_reason="stop",
            reward=0.0,
        )


def test_score_group_with_overlong_shaping_and_dynamic_sampling():
    samples = [sample(0, (5,) * 2, 1.0), sample(1, (5,) * 7, 1.0), sample(2, (5,) * 9, 0.0)]
    scoring = GroupScoring(
        advantage_scale="none", dynamic_sampling=True, overlong=OverlongShaping(max_len=8, buffer=4, penalty=0.5)
    )
    group = score_group(step=0, prompt_index=2, samples=samples, scoring=scoring)
    # DAPO eq. 13 by hand: |y| <= 4 -> 0; 7 -> (4 - 7) / 4 = -0.75; 9 > 8 -> -1; times 0.5
    shaped = [1.0, 1.0 - 0.375, 0.0 - 0.5]
    torch.testing.assert_close(group.rewards, torch.tensor(shaped))
    torch.testing.assert_close(group.advantages, torch.tensor([r - statistics.mean(shaped) for r in shaped]))
    assert group.kept and group.num_packed_tokens == 3 + 18
    flat = score_group(step=0, prompt_index=0, samples=samples[:2], scoring=GroupScoring(dynamic_sampling=True))
    assert not flat.kept and torch.equal(flat.advantages, torch.zeros(2))
    with pytest.raises(ValueError, match="'batch'"):
        GroupScoring(advantage_scale="batch")


def test_make_micro_batch_lines_up_with_the_packing():
    g1 = score_group(
        step=4, prompt_index=0, samples=[sample(0, (7, 8), 1.0, 3), sample(1, (9,), 0.0, 4)], scoring=GroupScoring()
    )
    g2 = score_group(
        step=4,
        prompt_index=1,
        samples=[sample(0, (6, 6, 6), 0.0, 4, prompt=(2,)), sample(1, (5,), 1.0, 2, prompt=(2,))],
        scoring=GroupScoring(),
    )
    mb = make_micro_batch([g1, g2], policy_version=4)
    assert mb.packed.token_ids.tolist() == [1, 2, 3, 7, 8, 9, 2, 6, 6, 6, 5]
    assert mb.packed.target_ids.tolist() == [7, 8, 9, 6, 6, 6, 5]
    a = 1 / (2**0.5 + 1e-6)  # +-0.5 over an unbiased std of sqrt(0.5)
    torch.testing.assert_close(mb.advantages, torch.tensor([a, -a, -a, a]))
    torch.testing.assert_close(mb.token_advantages, torch.tensor([a, a, -a, -a, -a, -a, a]))
    torch.testing.assert_close(mb.behav_logprobs, torch.tensor([-0.1, -0.2, -0.1, -0.1, -0.2, -0.3, -0.1]))
    assert mb.versions.tolist() == [3, 4, 4, 2] and mb.token_versions.tolist() == [3, 3, 4, 4, 4, 4, 2]
    assert mb.staleness.tolist() == [1, 0, 0, 2]
    flat = score_group(
        step=4, prompt_index=2, samples=[sample(0, (1,), 1.0)] * 2, scoring=GroupScoring(dynamic_sampling=True)
    )
    with pytest.raises(ValueError, match="dropped by dynamic sampling"):
        make_micro_batch([g1, flat], policy_version=4)


def test_unshare_prompts_packs_each_response_after_its_own_prompt_copy():
    from megatron_rl.pipeline.records import unshare_prompts

    g1 = score_group(
        step=4, prompt_index=0, samples=[sample(0, (7, 8), 1.0, 3), sample(1, (9,), 0.0, 4)], scoring=GroupScoring()
    )
    g2 = score_group(
        step=4,
        prompt_index=1,
        samples=[sample(0, (6, 6, 6), 0.0, 4, prompt=(2,)), sample(1, (5,), 1.0, 2, prompt=(2,))],
        scoring=GroupScoring(),
    )
    mb = make_micro_batch([g1, g2], policy_version=4)
    k = unshare_prompts(mb)
    assert k.packed.token_ids.tolist() == [1, 2, 3, 7, 8, 1, 2, 3, 9, 2, 6, 6, 6, 2, 5]  # written out by hand
    assert k.packed.target_ids.tolist() == mb.packed.target_ids.tolist()  # same responses, same order
    for field in ("advantages", "behav_logprobs", "versions"):
        assert torch.equal(getattr(k, field), getattr(mb, field))
