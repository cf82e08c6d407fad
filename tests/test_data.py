"""megatron_rl.data: sources (reasoning_gym, jsonl, parquet), tokenization, the prompt stream.

Expected values are written out here: token ids from a word-level tokenizer built in the test
and a hand-written rendering of its chat template, stream batches from the documented
per-epoch permutations, records from reasoning_gym itself.
"""

from __future__ import annotations

import json
import logging
import re
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from megatron_rl.data import (
    ANSWER_INSTRUCTION,
    ChatMessage,
    PromptRecord,
    PromptStream,
    load_records,
    tokenize_prompt,
    tokenize_records,
)

# ---------------------------------------------------------------- sources


def test_reasoning_gym_records_match_the_library():
    import reasoning_gym

    records = load_records("reasoning_gym:basic_arithmetic", size=5, seed=3)
    expected = list(reasoning_gym.create_dataset("basic_arithmetic", size=5, seed=3))
    assert [r.text for r in records] == [e["question"] for e in expected]
    assert [r.answer for r in records] == [e["answer"] for e in expected]
    assert [r.prompt_id for r in records] == [f"basic_arithmetic:3:{i}" for i in range(5)]
    assert records[0].metadata["reasoning_gym"] == "basic_arithmetic"
    assert records[0].metadata["entry"]["answer"] == expected[0]["answer"]
    assert load_records("reasoning_gym:basic_arithmetic", size=5, seed=3) == records


def test_reasoning_gym_errors():
    with pytest.raises(ValueError, match="no_such_dataset"):
        load_records("reasoning_gym:no_such_dataset", size=2)
    with pytest.raises(ValueError, match="needs size"):
        load_records("reasoning_gym:basic_arithmetic")


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_records(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = _write_jsonl(
        tmp_path / "train.jsonl",
        [
            json.dumps({"q": "What is 1+1?", "a": "2", "level": 1}),
            "",
            json.dumps({"q": chat, "a": 4}),
            json.dumps({"q": "unused", "a": "x"}),
        ],
    )
    records = load_records(str(path), prompt_key="q", answer_key="a", size=2)
    assert len(records) == 2
    assert records[0] == PromptRecord(prompt_id="train.jsonl:1", text="What is 1+1?", answer="2", metadata={"level": 1})
    assert records[1].prompt_id == "train.jsonl:3" and records[1].text is None
    assert records[1].messages == (
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="2+2?"),
    )
    assert records[1].answer == "4"


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        ('{"question": "q"}', r"train\.jsonl:3: missing key 'answer' \(answer_key\)"),
        ('{"answer": "1"}', r"train\.jsonl:3: missing key 'question' \(prompt_key\)"),
        ('{"question": "q", "answer": [1]}', r"train\.jsonl:3: answer 'answer' must be a string or a number"),
        ('{"question": 7, "answer": "1"}', r"train\.jsonl:3: prompt 'question' must be a string or a list"),
        ('{"question": [{"role": "robot", "content": "hi"}], "answer": "1"}', r"train\.jsonl:3: .*role"),
        ('{"question": "q", "answer": "1"', r"train\.jsonl:3: invalid JSON"),
        ("[1, 2]", r"train\.jsonl:3: expected a JSON object"),
    ],
)
def test_jsonl_errors_name_file_line_and_key(tmp_path, line, pattern):
    good = json.dumps({"question": "q", "answer": "1"})
    path = _write_jsonl(tmp_path / "train.jsonl", [good, good, line])
    with pytest.raises(ValueError, match=pattern) as err:
        load_records(str(path))
    assert str(tmp_path) in str(err.value)


def test_file_source_errors(tmp_path):
    with pytest.raises(ValueError, match="data.source: .* 'reasoning_gym:<dataset>'"):  # the config's rule
        load_records(str(tmp_path / "data.csv"))
    with pytest.raises(ValueError, match="no such file"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="data.size: must be > 0, got 0"):
        load_records(str(tmp_path / "missing.jsonl"), size=0)


def test_parquet_records(tmp_path, monkeypatch):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    path = tmp_path / "train.parquet"
    pd.DataFrame({"question": ["a?", "b?"], "answer": [3, 4], "src": ["x", "y"]}).to_parquet(path)
    records = load_records(str(path))
    assert [(r.prompt_id, r.text, r.answer, dict(r.metadata)) for r in records] == [
        ("train.parquet:0", "a?", "3", {"src": "x"}),
        ("train.parquet:1", "b?", "4", {"src": "y"}),
    ]
    with pytest.raises(ValueError, match=r"train\.parquet row 0: missing key 'prompt'"):
        load_records(str(path), prompt_key="prompt")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # find_spec -> None: pyarrow "not installed"
    with pytest.raises(ValueError, match="needs pyarrow"):
        load_records(str(path))


def test_record_validation():
    with pytest.raises(ValueError, match="exactly one of text or messages"):
        PromptRecord(prompt_id="p", answer="1")
    with pytest.raises(ValueError, match="end with a user turn"):
        PromptRecord(prompt_id="p", answer="1", messages=(ChatMessage(role="assistant", content="x"),))


# ---------------------------------------------------------------- tokenization

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)
WORDS = re.compile(r"\w+|[^\w\s]+")  # the Whitespace pre-tokenizer's split


def _word_tokenizer(text_seen: str) -> tuple[PreTrainedTokenizerFast, dict[str, int]]:
    """Word-level tokenizer over the words of `text_seen`, BOS "<s>" = 0, a chat template."""
    vocab = {"<s>": 0, "[UNK]": 1}
    for w in WORDS.findall(text_seen):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]")
    fast.chat_template = TEMPLATE
    return fast, vocab


def test_tokenize_with_chat_template_and_instruction():
    record = PromptRecord(prompt_id="p", text="What is 7 + 8 ?", answer="15")
    expected_text = f"<user> What is 7 + 8 ?\n\n{ANSWER_INSTRUCTION} </s> <assistant> "
    tok, vocab = _word_tokenizer(expected_text)
    ids = tokenize_prompt(record, tok, chat_template=True, max_prompt_tokens=100)
    assert ids == [vocab[w] for w in WORDS.findall(expected_text)]
    assert 0 not in ids  # no BOS added on top of the template


def test_tokenize_chat_messages_appends_instruction_to_last_user_turn():
    record = PromptRecord(
        prompt_id="p",
        answer="4",
        messages=(ChatMessage(role="system", content="Be brief ."), ChatMessage(role="user", content="2 + 2 ?")),
    )
    expected_text = "<system> Be brief . </s> <user> 2 + 2 ?\n\nBox it . </s> <assistant> "
    tok, vocab = _word_tokenizer(expected_text)
    ids = tokenize_prompt(record, tok, chat_template=True, max_prompt_tokens=100, instruction="Box it .")
    assert ids == [vocab[w] for w in WORDS.findall(expected_text)]
    with pytest.raises(ValueError, match="needs chat_template=True"):
        tokenize_prompt(record, tok, chat_template=False, max_prompt_tokens=100)


def test_tokenize_plain_text_adds_bos():
    record = PromptRecord(prompt_id="p", text="one two", answer="x")
    tok, vocab = _word_tokenizer("one two three")
    ids = tokenize_prompt(record, tok, chat_template=False, max_prompt_tokens=100, instruction="three")
    assert ids == [0, vocab["one"], vocab["two"], vocab["three"]]
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_prompt(record, tok, chat_template=True, max_prompt_tokens=100)


def test_over_long_prompts_are_dropped_and_counted(caplog):
    short = PromptRecord(prompt_id="short", text="a b", answer="x")  # <s> a b c = 4 tokens
    long = PromptRecord(prompt_id="long", text="a b a b", answer="x")  # 6 tokens
    tok, _ = _word_tokenizer("a b c")
    assert tokenize_prompt(long, tok, chat_template=False, max_prompt_tokens=5, instruction="c") is None
    assert tokenize_prompt(long, tok, chat_template=False, max_prompt_tokens=6, instruction="c") is not None
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.tokenization"):
        out = tokenize_records([short, long, short], tok, chat_template=False, max_prompt_tokens=5, instruction="c")
    assert [p.record.prompt_id for p in out.prompts] == ["short", "short"]
    assert out.dropped_ids == ["long"]
    assert "dropped 1 of 3" in caplog.text
    with pytest.raises(ValueError, match="max_prompt_tokens=3"):
        tokenize_records([short, long], tok, chat_template=False, max_prompt_tokens=3, instruction="c")


# ---------------------------------------------------------------- stream


def _expected_stream(n: int, batch: int, seed: int, num_batches: int) -> list[list[int]]:
    """Concatenated per-epoch permutations (module contract), cut into batches."""
    flat: list[int] = []
    epoch = 0
    while len(flat) < batch * num_batches:
        flat += np.random.default_rng([seed, epoch]).permutation(n).tolist()
        epoch += 1
    return [flat[i * batch : (i + 1) * batch] for i in range(num_batches)]


def test_stream_order_and_epoch_coverage():
    items = [f"p{i}" for i in range(10)]
    stream = PromptStream(items, prompts_per_batch=4, seed=7)
    got = [stream.next_batch() for _ in range(10)]  # 40 items = 4 epochs
    assert got == [[items[i] for i in b] for b in _expected_stream(10, 4, 7, 10)]
    flat = [x for b in got for x in b]
    for e in range(4):
        assert sorted(flat[10 * e : 10 * (e + 1)]) == sorted(items)
    assert flat[:10] != flat[10:20]  # reshuffled each epoch
    assert stream.state_dict() == {"epoch": 4, "position": 0}
    assert [next(iter(PromptStream(items, prompts_per_batch=4, seed=8)))] != got[:1]


def test_stream_resume_from_state_dict():
    items = list(range(7))
    a = PromptStream(items, prompts_per_batch=3, seed=1)
    for _ in range(5):  # 15 items: stops inside epoch 2
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"epoch": 2, "position": 1}
    b = PromptStream(items, prompts_per_batch=3, seed=1)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(6)] == [a.next_batch() for _ in range(6)]
    assert [a.next_batch() for _ in range(1)] == _expected_stream(7, 3, 1, 12)[11:]


def test_stream_errors():
    with pytest.raises(ValueError, match="prompts_per_batch"):
        PromptStream([1, 2], prompts_per_batch=3, seed=0)
    with pytest.raises(ValueError, match="prompts_per_batch"):
        PromptStream([1, 2], prompts_per_batch=0, seed=0)
    with pytest.raises(ValueError, match="out of range"):
        PromptStream([1, 2], prompts_per_batch=1, seed=0).load_state_dict({"epoch": 0, "position": 2})
