"""Broadcast weight sync at PP = 2 (each stage sends its own layers) equals snapshot sync: the
engine's greedy tokens and log-probs are identical after either, both differ from the
engine's starting weights, and every sync reports its bytes and seconds."""

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
    return [(got[f"{tag}{i}"].response_ids, got[f"{tag}{i}"].logprobs, got[f"{tag}{i}"].weight_version)
            for i in range(len(PROMPTS))]


def pp2_sync(hf_dir: str, snapshot_root: str):
    """Both ranks: PP = 2 model, perturbed; rank 0 owns a 2-worker hf engine. Broadcast sync
    (v1), snapshot sync of the same weights (v2), another broadcast (v3: the groups are reused)."""
    import torch

    from megatron_rl.models import load_model_from_hf
    from megatron_rl.parallel.state import initialize_parallel
    from megatron_rl.rollout import EngineSettings, build_engine
    from megatron_rl.trainer.rl_step import Replica, ReplicaChannel

    initialize_parallel(tp=1, pp=2)
    model, spec = load_model_from_hf(hf_dir)
    gen = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.03 * torch.randn(p.shape, generator=gen))
    channel = ReplicaChannel()
    engine = build_engine(EngineSettings(dtype="float32", engine="hf", model_path=hf_dir, num_engines=2,
                                         max_batch_size=3, weight_sync="broadcast", sync_bucket_mb=1,
                                         request_timeout_s=120)) if channel.is_leader else None
    trainer = SimpleNamespace(begin_batch=lambda: None)
    common = dict(engine=engine, snapshot_root=snapshot_root, source_dir=hf_dir, channel=channel)
    broadcast = Replica(trainer, model, spec, weight_sync="broadcast", **common)
    snapshot = Replica(trainer, model, spec, weight_sync="snapshot", **common)
    try:
        out = {"start": _greedy(engine, "s") if engine else None}
        for version, replica in ((1, broadcast), (2, snapshot), (3, broadcast)):
            replica.sync_weights(version)
            out[version] = (_greedy(engine, f"v{version}") if engine else None, replica.pop_results()[1])
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


def test_broadcast_at_pp2_equals_snapshot(synced):
    leader, _, _ = synced
    (b1, _), (s2, _), (b3, _) = leader[1], leader[2], leader[3]
    for (tokens, logprobs, _), (s_tokens, s_logprobs, _) in zip(b1, s2, strict=True):
        assert tokens == s_tokens and logprobs == s_logprobs  # bit-identical weights
    assert [r[:2] for r in b3] == [r[:2] for r in s2]
    assert [r[2] for r in b1] == [1] * 3 and [r[2] for r in b3] == [3] * 3
    assert any(a[1] != b[1] for a, b in zip(leader["start"], b1, strict=True)), "the sync changed nothing"


def test_every_sync_reports_bytes_and_seconds(synced):
    leader, follower, hf_dir = synced
    model_bytes = sum(t.nbytes for t in load_snapshot_tensors(hf_dir).values())
    assert model_bytes <= leader[2][1]["weight_sync_bytes"] < model_bytes + 100_000  # files: + headers
    for version in (1, 3):
        seconds = leader[version][1]
        assert seconds["weight_sync_bytes"] == model_bytes  # both stages' tensors, counted once
        assert 0 < seconds["weight_sync_transfer"] <= seconds["weight_sync"]
    assert 0 < follower[1][1]["weight_sync_transfer"]
