"""Prompt sources -> lists of `PromptRecord`: reasoning_gym generators, .jsonl and .parquet files.

    load_records("reasoning_gym:basic_arithmetic", size=1000, seed=0)
    load_records("data/train.jsonl", prompt_key="question", answer_key="answer", size=500)

Contract:
- `reasoning_gym:<name>` calls `reasoning_gym.create_dataset(name, size=size, seed=seed)`
  (offline, deterministic); the prompt is the entry's `question`, the answer its `answer`,
  and `metadata` holds {"reasoning_gym": name, "entry": <the entry dict>} for the
  `reasoning_gym` reward. `prompt_key` / `answer_key` do not apply.
- Files hold one object per row. The `prompt_key` field is a string (a plain prompt) or a
  list of {"role", "content"} objects (a chat); the `answer_key` field is a string or a
  number (converted with `str`). Every other field goes to `metadata`. Rows past `size` are
  ignored. A malformed row raises ValueError starting "<path>:<line>" (jsonl, 1-based, blank
  lines skipped but counted) or "<path> row <n>" (parquet, 0-based) and naming the key; with
  `skip_bad_rows=True` it is skipped instead, its message kept in `SourceRecords.bad_rows`
  (and the count logged). A missing file, a file without rows, or one whose rows are all
  malformed raise ValueError naming the file.
- `prompt_id` is "<name>:<seed>:<index>" for reasoning_gym and "<file name>:<line or row>"
  for files.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.config.fields import raise_found, require_values
from megatron_rl.config.resources import check_data_file
from megatron_rl.config.sections import data_source_rule
from megatron_rl.data.records import ChatMessage, PromptRecord

logger = logging.getLogger(__name__)

REASONING_GYM_PREFIX = "reasoning_gym:"


@dataclass(frozen=True, kw_only=True)
class SourceRecords:
    """The records of one source and the malformed rows skipped on the way."""

    records: list[PromptRecord]
    bad_rows: list[str]  # "<path>:<line>: <what is wrong>" per skipped row (skip_bad_rows only)


def load_records(
    source: str,
    *,
    prompt_key: str = "question",
    answer_key: str = "answer",
    size: int | None = None,
    seed: int = 0,
) -> list[PromptRecord]:
    """Records of `source` (see module doc); `size` is required for reasoning_gym."""
    return read_records(source, prompt_key=prompt_key, answer_key=answer_key, size=size, seed=seed).records


def read_records(
    source: str,
    *,
    prompt_key: str = "question",
    answer_key: str = "answer",
    size: int | None = None,
    seed: int = 0,
    skip_bad_rows: bool = False,
    options: Mapping[str, Any] | None = None,
) -> SourceRecords:
    """`load_records`, optionally skipping (and reporting) malformed rows instead of raising."""
    if size is not None:
        require_values({"data.size": size})  # the config's rules on data.size, data.source, data.options
    if source.startswith(REASONING_GYM_PREFIX):
        name = source.removeprefix(REASONING_GYM_PREFIX)
        return SourceRecords(records=reasoning_gym_records(name, size=size, seed=seed, options=options), bad_rows=[])
    raise_found(data_source_rule(source, options or {}))
    path = Path(source)
    if not path.is_file():
        raise_found(check_data_file(source))  # check-config's own "no such file"
    out = _file_records(path, prompt_key, answer_key, size, skip_bad_rows)
    if not out.records:
        what = f"all {len(out.bad_rows)} rows are malformed (first: {out.bad_rows[0]})" if out.bad_rows else "no rows"
        raise ValueError(f"data source {source!r}: {what}")
    if out.bad_rows:
        logger.warning(
            "data source %s: skipped %d malformed rows (first: %s)", source, len(out.bad_rows), out.bad_rows[0]
        )
    return out


def _file_records(path: Path, prompt_key: str, answer_key: str, size: int | None, skip: bool) -> SourceRecords:
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _parquet_rows(path)
    records, bad = [], []
    for n, row in rows:
        if size is not None and len(records) == size:
            break
        where = f"{path}:{n}" if path.suffix == ".jsonl" else f"{path} row {n}"
        try:
            if isinstance(row, ValueError):
                raise row
            records.append(
                record_from_row(
                    row, prompt_id=f"{path.name}:{n}", where=where, prompt_key=prompt_key, answer_key=answer_key
                )
            )
        except ValueError as err:  # one malformed row: its message names file, line and key
            if not skip:
                raise
            bad.append(str(err))
    return SourceRecords(records=records, bad_rows=bad)


def reasoning_gym_records(
    name: str, *, size: int | None, seed: int, options: Mapping[str, Any] | None = None
) -> list[PromptRecord]:
    """`size` generated problems of reasoning_gym dataset `name` (deterministic in `seed`);
    `options` go to its config (e.g. ``min_terms``, ``max_digits``)."""
    if size is None:
        raise ValueError(f"reasoning_gym:{name} needs size (number of problems to generate)")
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(name, size=size, seed=seed, **dict(options or {}))
    except (ValueError, TypeError, AssertionError) as err:  # unknown name or option, bad option value
        raise ValueError(f"data source 'reasoning_gym:{name}' (data.options {dict(options or {})}): {err}") from err
    return [
        PromptRecord(
            prompt_id=f"{name}:{seed}:{i}",
            text=entry["question"],
            answer=str(entry["answer"]),
            metadata={"reasoning_gym": name, "entry": entry},
        )
        for i, entry in enumerate(dataset)
    ]


def record_from_row(
    row: Mapping[str, Any],
    *,
    prompt_id: str,
    where: str,
    prompt_key: str,
    answer_key: str,
) -> PromptRecord:
    """One file row -> PromptRecord; a ValueError starts with `where` ("file:line") and names the key."""
    for key, what in ((prompt_key, "prompt_key"), (answer_key, "answer_key")):
        if key not in row:
            raise ValueError(f"{where}: missing key {key!r} ({what}); keys present: {sorted(row)}")
    prompt, answer = row[prompt_key], row[answer_key]
    if isinstance(answer, bool) or not isinstance(answer, str | numbers.Number):
        raise ValueError(f"{where}: answer {answer_key!r} must be a string or a number, got {type(answer).__name__}")
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    if isinstance(prompt, str):
        return PromptRecord(prompt_id=prompt_id, text=prompt, answer=str(answer), metadata=metadata)
    messages = _messages(prompt, where, prompt_key)
    try:
        return PromptRecord(prompt_id=prompt_id, messages=messages, answer=str(answer), metadata=metadata)
    except ValueError as err:  # e.g. an empty chat, or one not ending with a user turn
        raise ValueError(f"{where}: prompt {prompt_key!r}: {err}") from err


def _messages(value: Any, where: str, key: str) -> tuple[ChatMessage, ...]:
    """A list of {"role", "content"} objects -> ChatMessages (ValueError otherwise)."""
    if not isinstance(value, list | tuple) or not all(isinstance(m, Mapping) for m in value):
        raise ValueError(
            f"{where}: prompt {key!r} must be a string or a list of "
            f"{{'role', 'content'}} objects, got {type(value).__name__}"
        )
    try:
        return tuple(ChatMessage(role=m.get("role"), content=m.get("content")) for m in value)
    except ValueError as err:
        raise ValueError(f"{where}: prompt {key!r}: {err}") from err


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | ValueError]]:
    """(1-based line number, object) for every non-blank line of a JSON-lines file; a line that
    is not a JSON object comes as a ValueError naming file and line (raised or skipped by the caller)."""
    with path.open("rb") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield line_no, ValueError(f"{path}:{line_no}: not UTF-8 text: {err}")
                continue
            except (ValueError, RecursionError) as err:  # JSONDecodeError, a huge int, deep nesting
                yield line_no, ValueError(f"{path}:{line_no}: invalid JSON: {err}")
                continue
            if not isinstance(row, dict):
                row = ValueError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
            yield line_no, row


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(0-based row, dict of Python values) for every row of a parquet file (needs pyarrow)."""
    if importlib.util.find_spec("pyarrow") is None:
        raise ValueError(f"data source {str(path)!r}: reading .parquet needs pyarrow (pip install pyarrow)")
    import pyarrow.parquet as pq

    yield from enumerate(pq.read_table(path).to_pylist())
