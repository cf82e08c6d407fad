"""Bad data input: missing or empty files and malformed rows are named (file and line);
with ``skip_bad_rows`` malformed rows are skipped and counted, as are prompts over
``max_prompt_tokens`` (``DataReport``); plus a hypothesis fuzz of the jsonl loader."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rl.config import DataConfig
from megatron_rl.data import load_prompts, load_records, read_records
from tests.test_data import _word_tokenizer

GOOD = json.dumps({"question": "a b", "answer": "1"})
LONG = json.dumps({"question": "a b a b a b", "answer": "2"})


def _jsonl(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_file_is_named(tmp_path, text):
    (tmp_path / "empty.jsonl").write_text(text)
    with pytest.raises(ValueError, match=r"empty\.jsonl'?: no rows"):
        load_records(str(tmp_path / "empty.jsonl"))


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"missing\.jsonl'?: no such file"):
        load_prompts(str(tmp_path / "missing.jsonl"), None, max_prompt_tokens=8, chat_template=False)


def test_malformed_rows_are_skipped_counted_and_named(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(
        "\n".join([GOOD, '{"question": "a"', "[1]", GOOD, '{"answer": "3"}', ""]).encode()
        + b"\n\xff\xfe{}\n"
        + GOOD.encode()
        + b"\n"
    )
    tok, _ = _word_tokenizer("a b c")
    prompts, report = load_prompts(
        str(path),
        tok,
        max_prompt_tokens=8,
        chat_template=False,
        instruction="c",
        skip_bad_rows=DataConfig(source="x.jsonl").skip_bad_rows,
    )
    assert [p.record.prompt_id for p in prompts] == ["train.jsonl:1", "train.jsonl:4", "train.jsonl:8"]
    assert [re.match(rf"{re.escape(str(path))}:(\d+): ", b).group(1) for b in report.bad_rows] == ["2", "3", "5", "7"]
    assert "invalid JSON" in report.bad_rows[0] and "expected a JSON object" in report.bad_rows[1]
    assert "missing key 'question'" in report.bad_rows[2] and "not UTF-8" in report.bad_rows[3]
    assert report.as_metrics() == {"data/prompts": 3.0, "data/bad_rows": 4.0, "data/too_long": 0.0}
    assert f"4 malformed rows skipped (first: {path}:2: invalid JSON" in report.summary()
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}:2: invalid JSON"):
        read_records(str(path), skip_bad_rows=False)


def test_all_rows_malformed_is_an_error_naming_the_first(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", ["{", "[]"])
    with pytest.raises(ValueError, match=r"all 2 rows are malformed \(first: .*bad\.jsonl:1: invalid JSON"):
        read_records(path, skip_bad_rows=True)


def test_over_long_prompts_are_skipped_counted_and_named(tmp_path):
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, LONG, GOOD])
    tok, _ = _word_tokenizer("a b c")
    prompts, report = load_prompts(path, tok, max_prompt_tokens=5, chat_template=False, instruction="c")
    assert len(prompts) == 2 and report.too_long == ("train.jsonl:2",)
    assert report.as_metrics()["data/too_long"] == 1.0
    assert "1 prompts longer than max_prompt_tokens skipped (first: train.jsonl:2)" in report.summary()
    with pytest.raises(ValueError, match="max_prompt_tokens=2"):
        load_prompts(path, tok, max_prompt_tokens=2, chat_template=False, instruction="c")


# ---------------------------------------------------------------- fuzz

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n"), max_size=30)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)
_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "robot"]), "content": _TEXT | st.integers()}
)
_ROW = st.fixed_dictionaries(
    {},
    optional={
        "question": _TEXT | st.lists(_MESSAGE, max_size=3) | _JSON,
        "answer": _TEXT | st.integers() | _JSON,
        "extra": _JSON,
    },
)
_LINE = st.one_of(
    _ROW.map(lambda row: json.dumps(row).encode()),
    _JSON.map(lambda value: json.dumps(value).encode()),
    _TEXT.map(str.encode),
    st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_LINE, max_size=8))
def test_fuzz_jsonl_loads_or_names_the_line(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        rows = [n for n, line in enumerate(lines, start=1) if line.strip()]
        try:
            out = read_records(str(path), skip_bad_rows=True)
        except ValueError as err:
            assert "no rows" in str(err) or "malformed" in str(err)
            return
        assert len(out.records) + len(out.bad_rows) == len(rows)
        for message in out.bad_rows:
            line = int(re.match(rf"{re.escape(str(path))}:(\d+): ", message).group(1))
            assert line in rows
        try:
            strict = read_records(str(path))
        except ValueError as err:
            assert re.search(r"fuzz\.jsonl'?:\d+", str(err)), str(err)
        else:
            assert strict.records == out.records and not out.bad_rows
