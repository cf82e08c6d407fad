"""Rollout engines on other nodes (issue 19): two launches of ``examples/launch.sh`` on localhost
(--nnodes 2, one training rank each: DP = 2) whose node 1 runs engines in its engine host
(``megatron_rl serve``, started by the launcher), reached by rank 0's dispatcher over TCP
(``rollout.remote``) and given weights by the ``broadcast`` transport.

Reference: the one-node DP = 1 sync run of the same config (``test_data_parallel``'s helpers).
- engines on node 1 only, periodic mode, and a crash injected in node 1's worker mid-batch
  (``serve --chaos-crash``): the worker dies before answering, is restarted by its host, its
  requests re-issued; the run ends with the reference weights (≤ 1e-5), every request of the
  recording once, and every behaviour log-prob equal to a transformers forward of the
  checkpoint of the version that sampled it;
- engines on both nodes (one each), sync mode: the reference weights again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.distributed import free_port
from tests.rl_fixtures import TRAIN_PLATFORM, make_tiny_rl_model, tiny_rl_config
from tests.test_data_parallel import _max_diff, _run
from tests.test_rl_loop import assert_engine_sampled_from_trained_weights

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

REPO = Path(__file__).resolve().parents[1]
STEPS = 2
COMMON = [
    "trainer.save_every=1",
    "trainer.mini_batches=2",
    f"trainer.steps={STEPS}",
    "rollout.weight_sync=broadcast",
    "rollout.request_timeout_s=60",
    "rollout.start_timeout_s=120",
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remote")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        data={"max_prompt_tokens": 128},
        rollout={"max_batch_size": 4},
        trainer={"steps": STEPS, "prompts_per_batch": 4, "lr": 1e-2, "adam_eps": 1e-3},
    )
    reference, _, _ = _run(tmp, str(config), "reference", 1, [*COMMON, "pipeline.mode=sync"])
    return tmp, str(config), reference


def _launch_two_nodes(tmp: Path, config: str, name: str, overrides: list[str], chaos: list[str] = ()) -> Path:
    """Two ``examples/launch.sh`` invocations (node 0 and 1, one rank each) of one run; its save dir."""
    out, port = tmp / name, free_port()
    args = [
        *COMMON,
        *overrides,
        f"rollout.engine_port={free_port()}",
        f"trainer.save_dir={out}",
        f"trainer.log_dir={tmp / (name + '_logs')}",
        f"rollout.record={tmp / (name + '.jsonl')}",
    ]
    env = {
        **os.environ,
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NPROC_PER_NODE": "1",
        "PLATFORM": TRAIN_PLATFORM,
        "PY": sys.executable,
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            ["bash", str(REPO / "examples" / "launch.sh"), config, *args],
            env={**env, "NODE_RANK": str(node), "SERVE_ARGS": " ".join(chaos)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    assert "engine host: engines" in logs[1], logs[1][-2000:]  # node 1's host served its engines
    return out


def _recorded_samples(path: Path) -> list:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [
        SimpleNamespace(
            request_id=s["request_id"],
            prompt_ids=tuple(s["prompt_ids"]),
            response_ids=tuple(s["response_ids"]),
            logprobs=tuple(s["behav_logprobs"]),
        )
        for item in lines
        if item["kind"] == "group"
        for s in item["samples"]
    ]


def _assert_reference_weights(tmp: Path, reference: Path, out: Path) -> None:
    assert _max_diff(tmp, reference / f"step_{STEPS}") > 1e-3, "training did not move the weights"
    diff = _max_diff(reference / f"step_{STEPS}", out / f"step_{STEPS}")
    assert diff <= 1e-5, f"weights differ from the one-node run by {diff:.2e}"


def test_engines_on_node_1_survive_a_crash_and_train_like_one_node(setup):
    tmp, config, reference = setup
    markers = tmp / "chaos"
    out = _launch_two_nodes(
        tmp,
        config,
        "node1_periodic",
        ["pipeline.mode=periodic", "rollout.engine_nodes=[1]"],
        chaos=["--chaos-crash", "0.05", "--chaos-seed", "8", "--chaos-dir", str(markers)],
    )
    assert len(list(markers.iterdir())) >= 1, "no crash fired: the restart path was not exercised"
    samples = _recorded_samples(tmp / "node1_periodic.jsonl")
    ids = Counter(s.request_id for s in samples)
    assert len(ids) == STEPS * 4 * 4 and set(ids.values()) == {1}  # nothing lost, nothing twice
    assert_engine_sampled_from_trained_weights(tmp, out, samples)
    _assert_reference_weights(tmp, reference, out)


def test_engines_on_both_nodes_sync_run_equals_the_one_node_run(setup):
    tmp, config, reference = setup
    out = _launch_two_nodes(
        tmp, config, "both_sync", ["pipeline.mode=sync", "rollout.num_engines=2", "rollout.engine_nodes=[0,1]"]
    )
    _assert_reference_weights(tmp, reference, out)
