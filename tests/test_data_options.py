"""``data.options``: keyword arguments of a reasoning_gym dataset's config (e.g. easier problems
for a small model); refused for file sources and named when reasoning_gym rejects them."""

from __future__ import annotations

import re

import pytest

from megatron_rl.data.sources import read_records


def test_options_shape_the_generated_problems():
    out = read_records(
        "reasoning_gym:chain_sum",
        size=20,
        seed=0,
        options={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    )
    for r in out.records:
        numbers = re.findall(r"\d+", r.text.split(":")[-1])
        assert len(numbers) == 2 and all(len(n) == 1 for n in numbers), r.text


def test_options_are_for_reasoning_gym_only(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(ValueError, match="data.options: are keyword arguments of a reasoning_gym dataset"):
        read_records(str(path), options={"min_terms": 2})


def test_a_bad_option_is_named():
    with pytest.raises(ValueError, match=r"data.options \{'no_such_option': 1\}"):
        read_records("reasoning_gym:chain_sum", size=2, seed=0, options={"no_such_option": 1})
