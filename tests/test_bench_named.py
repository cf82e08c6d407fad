"""The named benchmarks (``megatron_rl/bench/benchmarks/``): one entry style for all.

Every module there is a benchmark exposing ``add_arguments(parser)`` and ``run(args)``, with a
docstring whose first paragraph ``bench --list`` shows; all of them import without TRL (the
package is shipped and used on clusters where TRL is absent); ``python -m megatron_rl bench
--list`` names each one; the shared runner prints ``run``'s dict as one JSON line, and a
``BenchmarkFailed`` result too, with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_benchmark_exposes_the_same_entry_and_imports_without_trl():
    from megatron_rl.bench.benchmarks import benchmark_names

    names = benchmark_names()
    assert {"attention", "dispatcher", "throughput", "trl_peer", "weight_sync"} <= set(names)
    code = (
        "import importlib, sys\n"
        f"for n in {names!r}:\n"
        "    m = importlib.import_module('megatron_rl.bench.benchmarks.' + n)\n"
        "    assert callable(m.add_arguments) and callable(m.run), n\n"
        "print(sorted(k for k in sys.modules if k == 'trl' or k.startswith('trl.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_bench_list_names_every_benchmark_with_a_description():
    from megatron_rl.bench.benchmarks import benchmark_names

    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl", "bench", "--list"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict(line.split(None, 1) for line in out.stdout.strip().splitlines())
    assert sorted(rows) == benchmark_names()
    assert all(len(description) > 20 and "\n" not in description for description in rows.values())


def _fake_benchmark(monkeypatch, run):
    """Benchmark ``fake`` whose ``run`` is ``run`` and whose one flag is ``--n``."""
    import megatron_rl.bench.benchmarks as benchmarks

    module = types.ModuleType("megatron_rl.bench.benchmarks.fake")
    module.add_arguments = lambda p: p.add_argument("--n", type=int, default=1)
    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(benchmarks, "describe", lambda name: "a fake")


def test_the_runner_prints_one_json_line_and_fails_with_the_result(monkeypatch, capsys):
    from megatron_rl.bench.benchmarks import BenchmarkFailed, run_benchmark

    seen: list[argparse.Namespace] = []
    _fake_benchmark(monkeypatch, lambda args: seen.append(args) or {"n": args.n})
    assert run_benchmark("fake", ["--n", "3"]) == 0
    assert json.loads(capsys.readouterr().out) == {"n": 3} and seen[0].argv == ("--n", "3")

    def failing(args):
        raise BenchmarkFailed({"error": "one run failed"})

    _fake_benchmark(monkeypatch, failing)
    assert run_benchmark("fake", []) == 1
    assert json.loads(capsys.readouterr().out) == {"error": "one run failed"}
    _fake_benchmark(monkeypatch, lambda args: None)  # a rank that does not report prints nothing
    assert run_benchmark("fake", []) == 0 and capsys.readouterr().out == ""
