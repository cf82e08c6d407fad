"""``python -m megatron_rl bench``: run one scope (or ``--compare`` variants) and print the table
and the JSON line (stdout's last line) on the rank that holds the result."""

from __future__ import annotations

import argparse
import sys

from megatron_rl.bench.compare import print_comparison, run_variants
from megatron_rl.bench.options import BenchOptions, options_from_args
from megatron_rl.bench.result import BenchResult, print_table
from megatron_rl.config import Config


def run_bench(cfg: Config, opts: BenchOptions) -> BenchResult | None:
    """Run ``opts.scope`` on ``cfg``; the result where it is reported (None on other ranks)."""
    if opts.scope == "train":
        from megatron_rl.bench.train_scope import run_train_scope

        return run_train_scope(cfg, opts)
    if opts.scope == "rollout":
        from megatron_rl.bench.rollout_scope import run_rollout_scope

        return run_rollout_scope(cfg, opts)
    from megatron_rl.bench.e2e_scope import run_e2e_scope

    return run_e2e_scope(cfg, opts)


def bench_command(cfg: Config, args: argparse.Namespace) -> int:
    """The CLI body (``args``: config, overrides and the flags of ``options.add_arguments``)."""
    try:
        opts = options_from_args(args)
    except ValueError as err:
        print(f"megatron_rl bench: {err}", file=sys.stderr)
        return 2
    if opts.compare:
        import os

        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print(
                "megatron_rl bench: --compare launches its own variant runs; start it as one process", file=sys.stderr
            )
            return 2
        print_comparison(run_variants(args.config, args.overrides, opts.to_argv(), opts.compare))
        return 0
    result = run_bench(cfg, opts)
    if result is not None:
        print_table(result)
        print(result.to_json(), flush=True)
    return 0
