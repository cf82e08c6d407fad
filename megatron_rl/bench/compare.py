"""``--compare``: one bench subprocess per override variant, run one after another, and their
ratios against the first variant (tokens/s/device, samples/s, completion tokens/s, step time)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

RATIO_KEYS = ("tokens_per_s_per_device", "samples_per_s", "completion_tokens_per_s", "step_s")


@dataclass(frozen=True, kw_only=True)
class VariantResult:
    """One variant: its overrides, its bench record and its ratios to the first variant."""

    overrides: tuple[str, ...]
    bench: dict
    ratios: dict[str, float]


def last_json_line(text: str) -> dict:
    """The ``{"bench": ...}`` record of the last JSON line of a bench run's stdout."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)["bench"]
    raise RuntimeError(f"bench printed no JSON line; its output ended with:\n{text[-2000:]}")


def run_variants(
    config: str, overrides: Sequence[str], bench_argv: Sequence[str], variants: Sequence[str]
) -> list[VariantResult]:
    """Run ``python -m megatron_rl bench`` once per variant (each a space-separated list of
    ``a.b=c`` overrides, applied after ``overrides``); stderr passes through."""
    records = []
    for variant in variants:
        extra = tuple(variant.split())
        if not extra or any("=" not in o for o in extra):
            raise ValueError(f"--compare {variant!r}: each variant is one or more a.b=value overrides")
        cmd = [sys.executable, "-m", "megatron_rl", "bench", config, *overrides, *extra, *bench_argv]
        print(f"megatron_rl bench: variant {' '.join(extra)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"variant {variant!r} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}")
        records.append((extra, last_json_line(proc.stdout)))
    base = records[0][1]
    return [
        VariantResult(
            overrides=extra, bench=rec, ratios={k: rec[k] / base[k] if base[k] else float("nan") for k in RATIO_KEYS}
        )
        for extra, rec in records
    ]


def print_comparison(results: Sequence[VariantResult], *, file=None) -> None:
    """A side-by-side table (rich when installed), then one JSON line with every variant."""
    out = file or sys.stdout
    header = ["variant", "tokens/s/dev", "samples/s", "compl. tok/s", "step s", "MFU", "ratio"]
    rows = [
        [
            " ".join(r.overrides),
            f"{r.bench['tokens_per_s_per_device']:.1f}",
            f"{r.bench['samples_per_s']:.2f}",
            f"{r.bench['completion_tokens_per_s']:.1f}",
            f"{r.bench['step_s']:.3f}",
            "n/a" if r.bench["mfu"] is None else f"{100 * r.bench['mfu']:.2f} %",
            f"{r.ratios['tokens_per_s_per_device']:.3f}",
        ]
        for r in results
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for row in [header, *rows]:
            print("  ".join(f"{c:>14}" for c in row), file=out)
    else:
        table = Table(title="megatron_rl bench --compare (ratio: tokens/s/device vs the first variant)")
        for name in header:
            table.add_column(name)
        for row in rows:
            table.add_row(*row)
        Console(file=out, width=140).print(table)
    print(
        json.dumps(
            {"compare": [{"overrides": list(r.overrides), "ratios": r.ratios, "bench": r.bench} for r in results]}
        ),
        file=out,
        flush=True,
    )
