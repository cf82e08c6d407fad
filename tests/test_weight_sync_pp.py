"""Broadcast and shared-memory weight sync at PP = 2 (each stage sends its own layers) equal
snapshot sync: the engine's greedy tokens and log-probs are identical after either, each sync
changes them, a worker restarted after a shared-memory sync gets the weights, and every sync
reports its bytes and seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import load_snapshot_tensors

PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]


def _greedy(engine, tag: str) -> list[tuple[tuple[int, ...], tuple[float, ...], int]]:
    from tests.rollout_reference import request, run_all

    got = run_all(engine, [request(f"{tag}{i}", p, temperature=0.0, max_new=6) for i, p in enumerate(PROMPTS)])
    return [
        (got[f"{tag}{i}"].response_ids, got[f"{tag}{i}"].logprobs, got[f"{tag}{i}"].weight_version)
        for i in range(len(PROMPTS))
    ]


def _perturb(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=gen))


def pp2_sync(hf_dir: str, snapshot_root: str):
    """Both ranks: PP = 2 model; rank 0 owns a 2-worker hf engine. Weights W1: broadcast (v1),
    snapshot (v2). Weights W2: shared memory (v3), a worker killed and restarted (it loads the
    shared files again), snapshot (v4). W3: shared memory (v5, the second write: the other file).
    W4: shared memory again (v6, the first file rewritten), snapshot (v7), broadcast again (v8:
    the groups are reused)."""
    import os
    import signal
    import time

    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.rollout import EngineSettings, build_engine
    from megatron_rl.trainer.replica import Replica, ReplicaChannel, SyncSettings

    initialize_parallel(tp=1, pp=2)
    model, spec = load_model_from_hf(hf_dir)
    channel = ReplicaChannel()
    engine = (
        build_engine(
            EngineSettings(
                dtype="float32",
                engine="hf",
                model_path=hf_dir,
                num_engines=2,
                max_batch_size=3,
                weight_sync="broadcast",
                request_timeout_s=120,
            )
        )
        if channel.is_leader
        else None
    )
    trainer = SimpleNamespace(begin_batch=lambda: None)
    common = dict(engine=engine, snapshot_root=snapshot_root, source_dir=hf_dir, channel=channel)
    replicas = {
        mode: Replica(trainer, model, spec, sync=SyncSettings(weight_sync=mode, bucket_mb=1), **common)
        for mode in ("broadcast", "snapshot", "shared_memory")
    }
    plan = (
        (1, "broadcast"),
        (2, "snapshot"),
        (3, "shared_memory"),
        (4, "snapshot"),
        (5, "shared_memory"),
        (6, "shared_memory"),
        (7, "snapshot"),
        (8, "broadcast"),
    )
    try:
        out = {"start": _greedy(engine, "s") if engine else None}
        for version, mode in plan:
            if version in (1, 3, 5, 6):
                _perturb(model, seed=version)
            replicas[mode].sync_weights(version)
            out[version] = (_greedy(engine, f"v{version}") if engine else None, replicas[mode].pop_results()[1])
            if version == 3 and engine is not None:
                os.kill(engine.status()[0].pid, signal.SIGKILL)
                out["restarted"] = _greedy(engine, "r")
                assert engine.status()[0].restarts == 1
        if engine is not None:  # after a PP = 2 broadcast a restart between syncs is refused, clearly
            os.kill(engine.status()[1].pid, signal.SIGKILL)
            time.sleep(1)  # dead before the call: it is restarted first (3 requests fit worker 0 alone)
            try:
                _greedy(engine, "x")
            except RuntimeError as err:
                out["restart_after_broadcast"] = str(err)
        return out
    finally:
        if engine is not None:
            engine.shutdown()


@pytest.fixture(scope="module")
def synced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weight_sync_pp")
    hf_dir = make_tiny_hf(tmp / "qwen2", "qwen2", seed=3, layers=2)
    leader, follower = run_distributed(pp2_sync, 2, str(hf_dir), str(tmp / "snapshots"), timeout_s=240)
    return leader, follower, hf_dir


def _same(a, b) -> bool:
    """Same greedy tokens and bit-identical log-probs (versions aside)."""
    return [r[:2] for r in a] == [r[:2] for r in b]


def test_broadcast_and_shared_memory_at_pp2_equal_snapshot(synced):
    leader, _, _ = synced
    results = {v: leader[v][0] for v in range(1, 9)}
    assert _same(results[1], results[2])  # broadcast == snapshot, weights W1
    assert _same(results[3], results[4])  # shared memory == snapshot: W2
    assert _same(results[8], results[7])  # broadcast == snapshot: W4
    assert not _same(leader["start"], results[1]) and not _same(results[2], results[3]), "a sync changed nothing"
    assert all([r[2] for r in results[v]] == [v] * 3 for v in results)


def test_shared_memory_syncs_in_a_row_hand_each_version_its_own_file(synced):
    """Three shared-memory writes at PP = 2 (v3, v5, v6: file 0, file 1, file 0 rewritten), each of
    new weights: every one changes the engine's output, and the last equals a snapshot of them."""
    leader, _, _ = synced
    results = {v: leader[v][0] for v in (3, 4, 5, 6, 7)}
    assert not _same(results[5], results[4]), "the second shared-memory sync handed the engine older weights"
    assert not _same(results[6], results[5]), "the third shared-memory sync handed the engine older weights"
    assert _same(results[6], results[7])  # shared memory == snapshot: W4


def test_worker_restarted_after_shared_memory_sync_gets_the_weights(synced):
    leader, _, _ = synced
    assert _same(leader["restarted"], leader[3][0])
    assert [r[2] for r in leader["restarted"]] == [3] * 3


def test_worker_restarted_after_a_pp2_broadcast_is_an_error_naming_the_fix(synced):
    leader, _, _ = synced
    message = leader.get("restart_after_broadcast", "no error")
    assert "rollout.weight_sync=broadcast" in message and "use 'snapshot'" in message


def test_every_sync_reports_bytes_and_seconds(synced):
    leader, follower, hf_dir = synced
    model_bytes = sum(t.nbytes for t in load_snapshot_tensors(hf_dir).values())
    assert model_bytes <= leader[2][1]["weight_sync_bytes"] < model_bytes + 100_000  # files: + headers
    for version in (1, 3, 5, 6, 8):
        seconds = leader[version][1]
        assert seconds["weight_sync_bytes"] == model_bytes  # both stages' tensors, counted once
        assert 0 < seconds["weight_sync_transfer"] <= seconds["weight_sync"]
    assert 0 < follower[1][1]["weight_sync_transfer"]
