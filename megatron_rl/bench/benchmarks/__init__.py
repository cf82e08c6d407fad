"""The named benchmarks: ``python -m megatron_rl bench <name> [args]``, one module each.

Every module here (the name is the benchmark's) exposes ``add_arguments(parser)`` (its flags)
and ``run(args) -> dict | None`` (its result, printed by ``run_benchmark`` as one JSON line on
stdout; None where another process prints it: a non-reporting rank, or a launcher whose ranks
do). ``args.argv`` holds the benchmark's own arguments, for those that relaunch themselves
under torchrun. A run that measured but failed raises ``BenchmarkFailed(result)``: the line is
still printed, the exit status is 1. Heavy or optional imports (TRL, vLLM) stay inside ``run``
so that listing and ``--help`` need neither. The module docstring's first paragraph is the
benchmark's one-line description (``--list``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import pkgutil
import sys
from collections.abc import Sequence
from pathlib import Path

_HERE = Path(__file__).resolve().parent


class BenchmarkFailed(Exception):
    """A benchmark measured something but failed: ``result`` is still printed, exit status 1."""

    def __init__(self, result: dict) -> None:
        super().__init__("benchmark failed")
        self.result = result


def benchmark_names() -> list[str]:
    """The benchmarks' names, sorted (one per module of this package)."""
    return sorted(m.name for m in pkgutil.iter_modules([str(_HERE)]) if not m.name.startswith("_"))


def describe(name: str) -> str:
    """The first paragraph of benchmark ``name``'s docstring, on one line (read without importing it)."""
    doc = ast.get_docstring(ast.parse((_HERE / f"{name}.py").read_text())) or ""
    return " ".join(doc.split("\n\n")[0].replace("``", "").split())


def list_benchmarks() -> str:
    """One line per benchmark: its name and its description."""
    names = benchmark_names()
    width = max(len(n) for n in names)
    return "\n".join(f"{n:{width}s}  {describe(n)}" for n in names)


def run_benchmark(name: str, argv: Sequence[str]) -> int:
    """Parse ``argv`` with benchmark ``name``'s flags, run it, print its result as one JSON line;
    the exit status."""
    module = importlib.import_module(f"{__name__}.{name}")
    parser = argparse.ArgumentParser(prog=f"python -m megatron_rl bench {name}", description=describe(name))
    module.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.argv = tuple(argv)
    status = 0
    try:
        result = module.run(args)
    except BenchmarkFailed as failed:
        result, status = failed.result, 1
    if result is not None:
        print(json.dumps(result), flush=True)
    return status


def bench_main(argv: Sequence[str]) -> int:
    """``bench --list`` or ``bench <name> [args]`` (``argv`` after ``bench``); the exit status."""
    if not argv or argv[0] in ("--list", "-l"):
        print(list_benchmarks())
        return 0
    if argv[0] not in benchmark_names():
        print(f"megatron_rl bench: no benchmark {argv[0]!r}; --list names them", file=sys.stderr)
        return 2
    return run_benchmark(argv[0], argv[1:])


def is_benchmark_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (after ``bench``) names a benchmark or ``--list`` (else: a config's throughput bench)."""
    return bool(argv) and (argv[0] in ("--list", "-l") or argv[0] in benchmark_names())


def relaunch_command(name: str, argv: Sequence[str], nproc: int) -> list[str]:
    """The torchrun command that runs benchmark ``name`` with ``argv`` as ``nproc`` ranks."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*run, "-m", "megatron_rl", "bench", name, *argv]
