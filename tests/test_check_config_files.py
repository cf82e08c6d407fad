"""``check-config`` checks what a config points at before a run: a data file that is missing or
has no rows, a model directory without config.json or a tokenizer, a reward / controller dotted
path that does not import; each error names the key and the value (exit 2, nothing started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.cli import main

HF_CONFIG = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vocab_size": 100,
}


def _model(tmp_path: Path, *, tokenizer: bool = True, config: bool = True) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    if config:
        (model / "config.json").write_text(json.dumps(HF_CONFIG))
    if tokenizer:
        (model / "tokenizer.json").write_text("{}")  # only its presence is checked before a run
    return model


def _config(tmp_path: Path, model: Path, source: str, **sections) -> Path:
    cfg = {"model": {"hf_path": str(model)}, "data": {"source": source}, "trainer": {"steps": 1}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _check(capsys, path: Path, *args: str) -> tuple[int, str]:
    code = main(["check-config", str(path), *args])
    return code, capsys.readouterr().err


def _prompts(tmp_path: Path, rows: int) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question": f"{i} + 1", "answer": str(i + 1)}) + "\n" for i in range(rows)))
    return path


def test_a_complete_config_passes(tmp_path, capsys):
    reward = {"fn": "tests.test_rewards:contains_answer"}
    path = _config(tmp_path, _model(tmp_path), str(_prompts(tmp_path, 3)), reward=reward)
    assert _check(capsys, path) == (0, "")


@pytest.mark.parametrize(("rows", "words"), [(None, ["no such file", "cwd"]), (0, ["has no rows"])])
def test_missing_or_empty_data_file(tmp_path, capsys, rows, words):
    source = str(_prompts(tmp_path, rows)) if rows is not None else "/nonexistent/prompts.jsonl"
    if rows == 0:
        Path(source).write_text("\n  \n")  # blank lines are not rows
    code, err = _check(capsys, _config(tmp_path, _model(tmp_path), source))
    assert code == 2 and f"data.source: {source!r}" in err
    for word in words:
        assert word in err


def test_empty_parquet_file(tmp_path, capsys):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    source = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"question": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), source)
    code, err = _check(capsys, _config(tmp_path, _model(tmp_path), str(source)))
    assert code == 2 and "data.source" in err and "has no rows" in err


def test_model_without_tokenizer(tmp_path, capsys):
    model = _model(tmp_path, tokenizer=False)
    code, err = _check(capsys, _config(tmp_path, model, str(_prompts(tmp_path, 2))))
    assert code == 2 and f"model.hf_path: {str(model)!r} has no tokenizer" in err and "tokenizer.json" in err


def test_model_without_config_json(tmp_path, capsys):
    model = _model(tmp_path, config=False)
    code, err = _check(capsys, _config(tmp_path, model, str(_prompts(tmp_path, 2))))
    assert code == 2 and "model.hf_path" in err and "has no config.json" in err


@pytest.mark.parametrize(
    ("section", "key", "spec", "words"),
    [
        ("reward", "fn", "no_such_pkg_xyz.rewards:score", ["cannot import module 'no_such_pkg_xyz.rewards'"]),
        ("reward", "fn", "tests.test_rewards:missing", ["has no attribute 'missing'"]),
        ("control", "kind", "no_such_pkg_xyz.ctl:Greedy", ["cannot import module"]),
    ],
)
def test_dotted_paths_must_import(tmp_path, capsys, section, key, spec, words):
    path = _config(tmp_path, _model(tmp_path), str(_prompts(tmp_path, 2)), **{section: {key: spec}})
    code, err = _check(capsys, path)
    assert code == 2 and f"{section}.{key}: {spec!r}" in err
    for word in words:
        assert word in err


def test_no_files_skips_them(tmp_path, capsys):
    path = _config(tmp_path, _model(tmp_path, tokenizer=False), "/nonexistent/prompts.jsonl")
    assert _check(capsys, path, "--no-files")[0] == 0
    code, err = _check(capsys, path)
    assert code == 2 and "data.source" in err and "model.hf_path" in err  # every problem at once
