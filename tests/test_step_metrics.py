"""The loop's per-step metrics: token counts equal sums over the engine's own results, the
phases make up the step, throughput follows from them, and the console shows the config once.

Reference: the results the (real, hf) engine handed out, recorded by a wrapper
(``tests.rl_fixtures.RecordingEngine``), not anything the pipeline computed.
"""

from __future__ import annotations

import statistics

import pytest

from megatron_rl.trainer.metrics import count_devices
from tests.distributed import run_distributed
from tests.rl_fixtures import make_tiny_rl_model, tiny_rl_config, train_recorded

PHASES = ("queue_wait", "train", "optimizer", "weight_sync", "idle")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        trainer={"steps": 3, "prompts_per_batch": 3, "log_dir": str(tmp / "log")},
        pipeline={"mode": "sync", "micro_batch_tokens": 256},
    )
    ((history, results),) = run_distributed(train_recorded, 1, str(config), [])
    return history, results


@pytest.mark.slow
@pytest.mark.multiproc
def test_token_counts_equal_the_engine_results(run):
    history, results = run
    assert len(history) == 3 and len(results) == 3 * 3 * 4
    for step, metrics in enumerate(history):
        mine = [r for r in results if r.request_id.split("/")[0] == str(step)]  # ids are "<step>/<prompt>/<k>"
        assert len(mine) == 12
        lengths = sorted(len(r.response_ids) for r in mine)
        assert metrics["rollout/response_tokens"] == sum(lengths)
        assert metrics["train/prompt_tokens"] == sum(len(r.prompt_ids) for r in mine)
        assert metrics["rollout/response_len_max"] == lengths[-1]
        assert metrics["rollout/response_len_median"] == statistics.median(lengths)
        assert metrics["rollout/response_len_mean"] == pytest.approx(sum(lengths) / len(lengths))


@pytest.mark.slow
@pytest.mark.multiproc
def test_phases_make_up_the_step_and_give_the_throughput(run):
    history, _ = run
    for m in history:
        step = m["time/step_s"]
        assert all(m[f"time/{p}_s"] >= 0 for p in PHASES)
        assert sum(m[f"time/{p}_s"] for p in PHASES) == pytest.approx(step, rel=0.05)
        assert m["time/train_s"] > 0 and m["time/optimizer_s"] > 0 and m["time/weight_sync_s"] > 0
        tokens = m["train/prompt_tokens"] + m["rollout/response_tokens"]
        assert m["throughput/tokens_per_s_per_device"] == pytest.approx(tokens / 2 / step)  # 1 rank + 1 engine
        assert m["throughput/completion_tokens_per_s"] == pytest.approx(m["rollout/response_tokens"] / step)
        assert 0 < m["busy/trainer"] <= 1 and 0 <= m["busy/engines"] <= 1
        # sync mode: the engine generated (and loaded weights) inside this step, never idle all of it
        assert 0 < m["busy/engine_0"] <= 1
        # the rank's device peak (emulated: allocations on emulated:0, as on a GPU / NPU), every step
        assert 0 < m["memory/device_peak_gb"] == m["memory/peak_gb"] < 0.05  # a tiny model
        assert not any(k.startswith("control/control/") for k in m)


def test_count_devices():
    assert count_devices(1, ["cpu:1"], 1) == 2
    assert count_devices(4, ["cuda:4,5", "cuda:6,7"], 2) == 8
    assert count_devices(2, [], 2) == 4
    assert count_devices(1, ["cpu:0-3"], 1) == 5
