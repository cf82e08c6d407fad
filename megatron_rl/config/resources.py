"""What a config points at, checked without starting a run: the prompt file, the model
directory's config and tokenizer, the dotted paths of ``reward.fn``, ``control.kind`` and ``environment.kind``.

Contract: `check_resources(cfg)` yields ``(key, message)`` naming the key, the value and the fix
for a data file that is missing or has no rows, a model directory without ``config.json`` or
tokenizer files, a ``pkg.mod:Name`` path that does not import. `find_dotted(spec)` is the one
import of such a path (the reward and controller loaders use it too). Run by
``load_config(..., resources=True)`` (``check-config``, ``train``), not by `validate`: configs
are also validated where the data and the model are absent (tests, ``plan`` on a laptop).
Relative paths are relative to the current directory, as in a run.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .schema import Config

Found = Iterator[tuple[str, str]]  # (dotted key, message) pairs yielded by a check

# Any one of these makes a directory loadable by AutoTokenizer (fast, sentencepiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_resources(cfg: Config) -> Found:
    """Every problem of the files and import paths `cfg` names."""
    yield from check_data_file(cfg.data.source)
    yield from check_model_dir(cfg.model.hf_path)
    from .reward_rules import check_reward_files  # it imports this module

    yield from check_reward_files(cfg.reward)
    if cfg.distill.teacher is not None:  # on-policy distillation: the teacher's checkpoint, as the model's
        yield from (("distill.teacher", why) for _, why in check_model_dir(cfg.distill.teacher))
    for key, spec in (
        ("reward.fn", cfg.reward.fn),
        ("control.kind", cfg.control.kind),
        ("environment.kind", cfg.environment.kind),
        ("rollout.generator", cfg.rollout.generator),
        ("agent.run", cfg.agent.run),
    ):
        if ":" in spec:
            _, why = find_dotted(spec)
            if why:
                yield key, f"{spec!r}: {why}"


def find_dotted(spec: str) -> tuple[Any, str]:
    """``"pkg.mod:Name"`` -> (the object, "") or (None, why it cannot be had)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return None, f"cannot import module {module_name!r}: {err} (is its package on PYTHONPATH?)"
    if not hasattr(module, attr):
        return None, f"module {module_name!r} has no attribute {attr!r}"
    return getattr(module, attr), ""


def check_data_file(source: str) -> Found:
    """A .jsonl / .parquet source must be a file with at least one row."""
    if source.startswith("reasoning_gym:"):
        if importlib.util.find_spec("reasoning_gym") is None:
            yield "data.source", f"{source!r} needs the reasoning_gym package, which is not installed"
        return
    path = Path(source)
    if not path.is_file():
        yield "data.source", f"{source!r}: no such file (cwd {Path.cwd()}); give the path of a prompt file"
        return
    rows, why = _count_rows(path)
    if why:
        yield "data.source", f"{source!r} cannot be read: {why}"
    elif rows == 0:
        yield "data.source", f"{source!r} has no rows; it needs one prompt per line (.jsonl) or row (.parquet)"


def _count_rows(path: Path) -> tuple[int, str]:
    """(rows, "") or (0, why the file cannot be read); a .jsonl row is a non-blank line."""
    if path.suffix == ".parquet":
        if importlib.util.find_spec("pyarrow") is None:
            return 0, "reading .parquet needs pyarrow (pip install pyarrow)"
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(path).metadata.num_rows, ""
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            return 0, f"not a parquet file ({err})"
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip()), ""


def check_model_dir(hf_path: str) -> Found:
    """A HF checkpoint directory: config.json (valid JSON) and the files of a tokenizer."""
    path = Path(hf_path)
    if not path.is_dir():
        yield "model.hf_path", f"{hf_path!r} is not a directory (cwd {Path.cwd()}); point it at a local HF checkpoint"
        return
    config = path / "config.json"
    if not config.is_file():
        yield "model.hf_path", f"{hf_path!r} has no config.json; not a HF checkpoint"
    else:
        try:
            json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            yield "model.hf_path", f"{config} is not valid JSON: {err}"
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        yield (
            "model.hf_path",
            (
                f"{hf_path!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                "save the tokenizer next to the weights (tokenizer.save_pretrained)"
            ),
        )
