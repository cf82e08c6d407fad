"""Debug modes: ``rollout.record`` writes the producer's queue as JSONL; ``replay`` trains on it
with no engine and makes the same update as the live run; ``train --rollout-only`` generates and
scores without training (and can record)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.pipeline.recording import item_from_json, item_to_json, read_recording
from tests.distributed import run_distributed
from tests.pipeline_fakes import FakeEngine, FakeTrainer, make_pipeline, train_one_step
from tests.rl_fixtures import load_weights, make_tiny_rl_model, tiny_rl_config, train_run

REPO = Path(__file__).resolve().parents[1]


def test_queue_items_round_trip_exactly(tmp_path):
    engine, out = FakeEngine(), tmp_path / "rec.jsonl"
    trainer = FakeTrainer(engine)
    with make_pipeline(engine, num_steps=2, record=out) as pipe:
        summaries = [train_one_step(pipe, trainer) for _ in range(2)]
    back = list(read_recording(out))
    kinds = [type(i).__name__ for i in back]
    assert kinds == (["BatchStart"] + ["ScoredGroup"] * 6 + ["BatchEnd"]) * 2
    recorded = {(i.step, i.prompt_id): i for i in back if kinds[back.index(i)] == "ScoredGroup"}
    for mb in trainer.micro_batches:
        for g in mb.groups:
            assert item_to_json(recorded[(g.step, g.prompt_id)]) == item_to_json(g)  # exact, floats included
    ends = [i for i in back if type(i).__name__ == "BatchEnd"]
    assert [item_to_json(e) for e in ends] == [item_to_json(s.end) for s in summaries]


def test_a_malformed_recording_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"kind": "start", "step": 0, "num_prompts": 1, "group_size": 2}) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        list(read_recording(path))
    path.write_text(json.dumps({"kind": "group", "step": 0}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a recorded queue item"):
        item_from_json(json.loads(path.read_text()), where=f"{path}:1")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replay")
    model = make_tiny_rl_model(tmp / "model")
    config = tiny_rl_config(
        tmp,
        model,
        reward={"fn": "tests.rl_fixtures:digit_share_reward"},
        trainer={"steps": 3, "prompts_per_batch": 3, "lr": 1e-2, "adam_eps": 1e-3},
    )
    return tmp, str(config)


@pytest.mark.slow
@pytest.mark.multiproc
def test_replay_makes_the_update_of_the_live_run(setup):
    tmp, config = setup
    rec = tmp / "live.jsonl"
    (live,) = run_distributed(
        train_run,
        1,
        config,
        [f"rollout.record={rec}", f"trainer.save_dir={tmp / 'live'}", "trainer.save_every=1"],
        timeout_s=600,
    )
    assert rec.read_text().count('"kind": "group"') == 9
    (replayed,) = run_distributed(
        train_run, 1, config, [f"trainer.save_dir={tmp / 'replayed'}"], str(rec), timeout_s=600
    )
    assert [h["rollout/reward_mean"] for h in replayed] == [h["rollout/reward_mean"] for h in live]
    a, b = load_weights(tmp / "live" / "step_3" / "model"), load_weights(tmp / "replayed" / "step_3" / "model")
    initial = load_weights(tmp / "model")
    assert max((a[k] - initial[k]).abs().max().item() for k in a) > 1e-3
    for key, value in a.items():
        assert ((b[key] - value).abs().max() / value.abs().max()).item() <= 1e-6, key
    # replayed from the live run's checkpoint after step 1: versions (and staleness) as live
    (resumed,) = run_distributed(
        train_run,
        1,
        config,
        [f"trainer.save_dir={tmp / 'replayed_from_1'}", f"trainer.resume_from={tmp / 'live' / 'step_1'}"],
        str(rec),
        timeout_s=600,
    )
    assert [h["train/version"] for h in resumed] == [h["train/version"] for h in live[1:]] == [2.0, 3.0]
    assert [h["rollout/staleness_max"] for h in resumed] == [0, 0]
    c = load_weights(tmp / "replayed_from_1" / "step_3" / "model")
    for key, value in a.items():
        assert ((c[key] - value).abs().max() / value.abs().max()).item() <= 1e-6, key


@pytest.mark.slow
@pytest.mark.multiproc
def test_rollout_only_generates_scores_and_records_without_training(setup):
    tmp, config = setup
    rec = tmp / "rollout_only.jsonl"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl",
            "train",
            config,
            "--rollout-only",
            "trainer.steps=2",
            f"rollout.record={rec}",
            f"trainer.log_dir={tmp / 'rollout_only_logs'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    items = list(read_recording(rec))
    assert [i.step for i in items if type(i).__name__ == "BatchEnd"] == [0, 1]
    assert sum(type(i).__name__ == "ScoredGroup" for i in items) == 6
    rows = [json.loads(line) for line in (tmp / "rollout_only_logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/version"] for r in rows] == [1.0, 2.0] and all("loss/value" not in r for r in rows)


@pytest.mark.slow
@pytest.mark.multiproc
def test_k_copies_layout_makes_the_same_update(setup):
    """attention.shared_prompt=false (every response after its own prompt copy, plain causal
    attention per sample: the independent layout) trains the same weights as shared-prompt packing."""
    tmp, config = setup
    rec = tmp / "live.jsonl"
    if not rec.exists():
        run_distributed(train_run, 1, config, [f"rollout.record={rec}"], timeout_s=600)
    runs = {}
    for shared in ("true", "false"):
        out = tmp / f"shared_{shared}"
        overrides = [f"trainer.save_dir={out}", f"attention.shared_prompt={shared}"]
        run_distributed(train_run, 1, config, overrides, str(rec), timeout_s=600)
        runs[shared] = load_weights(out / "step_3" / "model")
    a, b = runs["true"], runs["false"]
    initial = load_weights(tmp / "model")
    assert max((a[k] - initial[k]).abs().max().item() for k in a) > 1e-3
    for key, value in a.items():
        assert ((b[key] - value).abs().max() / value.abs().max()).item() <= 1e-5, key
