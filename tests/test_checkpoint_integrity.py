"""Checkpoint integrity and safe loading (``trainer/checkpoint.py``), without a training run:
a manifest written last and verified at load; a truncated, corrupted or missing file named in
the error; optimizer state that loads with ``weights_only=True`` (and a pickle that would run
code refused even when the manifest was forged to match it)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from megatron_rl.trainer.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    RunState,
    finalize,
    load_optimizer,
    load_run_state,
    save_optimizer,
    staging_dir,
    write_manifest,
)


def _adam(seed: int) -> torch.optim.Adam:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    model(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    return opt


def _save(tmp_path: Path, opt) -> Path:
    staging = staging_dir(tmp_path / "step_1")
    (staging / "model").mkdir(parents=True)
    (staging / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (staging / "model" / "config.json").write_text('{"model_type": "qwen2"}')
    save_optimizer(opt, staging)
    state = RunState(step=1, controller={"g": 8}, prompt_stream={"epoch": 0, "position": 4}, config={"a": 1})
    return finalize(staging, state)


def test_round_trip_restores_the_optimizer_exactly(tmp_path):
    opt = _adam(0)
    path = _save(tmp_path, opt)
    assert not staging_dir(path).exists() and (path / MANIFEST_FILE).is_file()
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    assert set(listed) == {"model/model.safetensors", "model/config.json", "optimizer/rank_0.pt", "trainer_state.json"}
    assert load_run_state(path).prompt_stream == {"epoch": 0, "position": 4}
    fresh = _adam(1)
    load_optimizer(fresh, path)
    want, got = opt.state_dict(), fresh.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, s in want["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(got["state"][i][k], v, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["model/model.safetensors", "optimizer/rank_0.pt", "trainer_state.json"])
def test_truncated_file_is_named(tmp_path, name):
    path = _save(tmp_path, _adam(0))
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"file {name} is truncated"):
        load_run_state(path)


@pytest.mark.parametrize("name", ["model/model.safetensors", "optimizer/rank_0.pt"])
def test_flipped_byte_is_named(tmp_path, name):
    path = _save(tmp_path, _adam(0))
    data = bytearray((path / name).read_bytes())
    data[len(data) // 3] ^= 0x01
    (path / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"file {name} is corrupted"):
        load_run_state(path)


def test_missing_file_or_manifest_is_named(tmp_path):
    path = _save(tmp_path, _adam(0))
    (path / "model" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="file model/config.json is missing"):
        load_run_state(path)
    (path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=f"{MANIFEST_FILE} is unreadable"):
        load_run_state(path)
    (path / MANIFEST_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"no {MANIFEST_FILE}"):
        load_run_state(path)


class _Payload:
    """Unpickling this would run ``print`` (any callable could be there)."""

    def __reduce__(self):
        return (print, ("pwned",))


def test_pickled_code_is_refused_even_with_a_matching_manifest(tmp_path):
    path = _save(tmp_path, _adam(0))
    with (path / "optimizer" / "rank_0.pt").open("wb") as f:
        pickle.dump({"state": _Payload()}, f)
    write_manifest(path)  # an attacker can rewrite the manifest too: weights_only still refuses
    load_run_state(path)
    with pytest.raises(CheckpointError, match=r"optimizer/rank_0.pt cannot be loaded safely"):
        load_optimizer(_adam(1), path)


def test_state_that_would_need_pickle_is_refused_at_save(tmp_path):
    class Odd:
        pass

    class OddOptimizer:
        def state_dict(self):
            return {"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": [{"lr": 1e-3, "sched": Odd()}]}

    with pytest.raises(CheckpointError, match=r"\['param_groups'\]\[0\]\['sched'\]: a Odd cannot be saved"):
        save_optimizer(OddOptimizer(), tmp_path / "staging")
