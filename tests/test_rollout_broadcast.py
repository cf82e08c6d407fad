"""Weight sync by collective broadcast (gloo here; NCCL / HCCL on devices, same code): the
engine's greedy output and log-probs after a broadcast equal the megatron trainer model with
the new weights; a worker killed mid-batch afterwards is restarted with those weights."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from megatron_rl.rollout import EngineSettings, build_engine
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import greedy_gap, load_snapshot_tensors, make_sender, request, run_all, trainer_update

pytestmark = [pytest.mark.multiproc]

PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout_broadcast")
    hf_dir = make_tiny_hf(tmp / "qwen2", "qwen2", seed=3, layers=2)
    snap = tmp / "step1"
    (reference,) = run_distributed(trainer_update, 1, str(hf_dir), str(snap), PROMPTS, 6)
    tensors = load_snapshot_tensors(snap)
    cores = sorted(os.sched_getaffinity(0))
    engine = build_engine(
        EngineSettings(
            dtype="float32",
            engine="hf",
            model_path=str(hf_dir),
            num_engines=2,
            max_batch_size=3,
            devices=(f"cpu:{cores[0]}", f"cpu:{cores[-1]}"),
            weight_sync="broadcast",
        )
    )
    sender = make_sender(engine, "broadcast", sorted(tensors.items()), tmp)  # its group outlives a sync
    sender.sync(1)
    yield engine, reference, sender
    engine.shutdown()


def test_broadcast_sync_matches_trainer_model(setup):
    engine, reference, _ = setup
    assert engine.weight_version == 1
    assert greedy_gap(engine, PROMPTS, reference, version=1) <= 1e-4


def test_killed_worker_gets_the_broadcast_weights(setup):
    engine, _, sender = setup
    reqs = [request(f"k{i}", PROMPTS[i % 3] + (i,), temperature=1.0, max_new=40, seed=i) for i in range(12)]
    expected = run_all(engine, reqs)
    stream = engine.generate(reqs)
    results = [next(stream)]
    victim = max(engine.status(), key=lambda s: len(s.in_flight))
    assert victim.in_flight, "no worker had requests in flight"
    os.kill(victim.pid, signal.SIGKILL)
    results += list(stream)
    assert Counter(r.request_id for r in results) == Counter(r.request_id for r in reqs)
    assert engine.status()[victim.index].restarts == victim.restarts + 1
    for r in results:  # the restarted worker was given version 1 by broadcast: same samples
        assert r.weight_version == 1
        assert r.response_ids == expected[r.request_id].response_ids
    # the next sync rebuilds the group with the new process and still reaches every worker
    sender.sync(2)
    again = run_all(engine, reqs)
    assert all(again[i].response_ids == expected[i].response_ids and again[i].weight_version == 2 for i in again)
