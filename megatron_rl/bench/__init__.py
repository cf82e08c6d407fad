"""Benchmarks: a config's throughput (``bench CONFIG --scope``) and the named ones (``bench <name>``).

``python -m megatron_rl bench CONFIG --scope e2e|train|rollout`` measures a run; ``python -m
megatron_rl bench <name> [args]`` runs one of ``benchmarks/`` (``bench --list``), each printing
one JSON line through the shared runner. Modules: ``options`` (the flags, one ``BenchOptions``),
``lengths`` (synthetic length distributions), ``flops`` (training FLOPs on the shared-prompt
layout, device peaks), ``result`` (per-step measures -> ``BenchResult``: JSON line and table),
``train_scope`` (the trainer alone on synthetic groups through the real packing path),
``rollout_scope`` (the engines alone), ``e2e_scope`` (the training loop), ``compare`` (variants
side by side), ``runner`` (the CLI body), ``attention`` (what the attention benchmark and the
device check measure), ``benchmarks`` (the named benchmarks and their runner).
"""

from megatron_rl.bench.flops import GroupShape, training_flops
from megatron_rl.bench.lengths import LengthDist
from megatron_rl.bench.options import BenchOptions
from megatron_rl.bench.result import PHASES, BenchResult, StepMeasure
from megatron_rl.bench.runner import bench_command, run_bench

__all__ = [
    "PHASES",
    "BenchOptions",
    "BenchResult",
    "GroupShape",
    "LengthDist",
    "StepMeasure",
    "bench_command",
    "run_bench",
    "training_flops",
]
