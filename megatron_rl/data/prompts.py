"""From a data source to the prompts a run trains on, with a report of what was skipped.

    prompts, report = load_prompts("data/train.jsonl", tokenizer, max_prompt_tokens=512,
                                   chat_template=True, skip_bad_rows=True)
    log(report.summary()); metrics |= report.as_metrics()

Contract: data-level problems never stop a run once something is left to train on; each is
skipped, counted in the `DataReport`, and named (the first of each kind) in `summary()`:
malformed rows (with `skip_bad_rows`; file and line in the message) and prompts longer than
`max_prompt_tokens` (dropped, never truncated). A missing or empty source, or one where
nothing is left, raises ValueError naming it (`sources.read_records`, `tokenize_records`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_rl.data.records import TokenizedPrompt
from megatron_rl.data.sources import read_records
from megatron_rl.data.tokenization import ANSWER_INSTRUCTION, tokenize_records


@dataclass(frozen=True, kw_only=True)
class DataReport:
    """What loading one source kept and skipped."""

    source: str
    records: int  # well-formed rows (or generated problems) read
    bad_rows: tuple[str, ...]  # "<path>:<line>: <what is wrong>" of each malformed row skipped
    too_long: tuple[str, ...]  # prompt_id of each prompt over max_prompt_tokens (dropped)
    prompts: int  # prompts kept for training

    def as_metrics(self, prefix: str = "data/") -> dict[str, float]:
        return {
            f"{prefix}prompts": float(self.prompts),
            f"{prefix}bad_rows": float(len(self.bad_rows)),
            f"{prefix}too_long": float(len(self.too_long)),
        }

    def summary(self) -> str:
        """One line: what was kept, and the first culprit of each kind skipped."""
        parts = [f"data source {self.source}: {self.prompts} prompts"]
        if self.bad_rows:
            parts.append(f"{len(self.bad_rows)} malformed rows skipped (first: {self.bad_rows[0]})")
        if self.too_long:
            parts.append(
                f"{len(self.too_long)} prompts longer than max_prompt_tokens skipped (first: {self.too_long[0]})"
            )
        return "; ".join(parts)


def load_prompts(
    source: str,
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    chat_template: bool,
    prompt_key: str = "question",
    answer_key: str = "answer",
    size: int | None = None,
    seed: int = 0,
    skip_bad_rows: bool = True,
    options: Mapping[str, Any] | None = None,
    instruction: str | None = ANSWER_INSTRUCTION,
) -> tuple[list[TokenizedPrompt], DataReport]:
    """The tokenized prompts of `source` and the `DataReport` (see module doc)."""
    read = read_records(
        source,
        prompt_key=prompt_key,
        answer_key=answer_key,
        size=size,
        seed=seed,
        skip_bad_rows=skip_bad_rows,
        options=options,
    )
    tokenized = tokenize_records(
        read.records,
        tokenizer,
        chat_template=chat_template,
        max_prompt_tokens=max_prompt_tokens,
        instruction=instruction,
    )
    report = DataReport(
        source=source,
        records=len(read.records),
        bad_rows=tuple(read.bad_rows),
        too_long=tuple(tokenized.dropped_ids),
        prompts=len(tokenized.prompts),
    )
    return tokenized.prompts, report
