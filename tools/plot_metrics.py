"""A PNG dashboard of a run's ``metrics.jsonl`` (``trainer.log_dir``).

    python tools/plot_metrics.py RUN_DIR [--out FILE]

Panels: reward, response lengths, throughput (tokens/s/device and completion tokens/s), the
phase breakdown of every step (stacked; the same exclusive phases as
``python -m megatron_rl bench``), and KL / clip fractions / mismatch (whichever ``loss/…`` and
``mismatch/…`` keys the run logged); multi-turn runs add turns per trajectory, tool calls /
errors / environment failures, and model vs observation tokens with the seconds in
environments. Writes ``RUN_DIR/dashboard.png`` by default (matplotlib,
Agg backend: no display needed) and prints its path.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from megatron_rl.bench.result import PHASES, phases_from_metrics  # noqa: E402

Rows = Sequence[Mapping[str, float | None]]
KL_CLIP_PREFIXES = ("loss/clip_frac", "loss/approx_kl", "loss/kl", "mismatch/kl", "loss/entropy")


def read_metrics(run_dir: Path) -> list[dict]:
    """The step records of ``run_dir/metrics.jsonl`` (a resumed run's later record of a step wins)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: point RUN_DIR at a run's trainer.log_dir")
    by_step = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    if not by_step:
        raise ValueError(f"{path} holds no step")
    return [by_step[s] for s in sorted(by_step)]


def series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` where it was logged and finite."""
    pts = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None and math.isfinite(float(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def throughput(row: Mapping[str, float | None]) -> dict[str, float]:
    """tokens/s/device (logged, or (prompt + response tokens) / step s when prompts are logged)
    and completion tokens/s of one step."""
    step_s = row.get("time/step_s") or 0.0
    out = {}
    if row.get("throughput/tokens_per_s_per_device") is not None:
        out["tokens/s/device"] = float(row["throughput/tokens_per_s_per_device"])
    elif step_s and row.get("train/prompt_tokens") is not None:
        tokens = row["train/prompt_tokens"] + (row.get("rollout/response_tokens") or 0)
        out["tokens/s (all devices)"] = tokens / step_s
    if row.get("throughput/completion_tokens_per_s") is not None:
        out["completion tokens/s"] = float(row["throughput/completion_tokens_per_s"])
    elif step_s and row.get("rollout/response_tokens") is not None:
        out["completion tokens/s"] = row["rollout/response_tokens"] / step_s
    return out


def _lines(ax, rows: Rows, keys: Sequence[str], title: str) -> None:
    for key in keys:
        steps, values = series(rows, key)
        if steps:
            ax.plot(steps, values, marker=".", label=key)
    ax.set_title(title)
    ax.set_xlabel("step")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)


def _throughput(ax, rows: Rows) -> None:
    per_step = [(r["step"], throughput(r)) for r in rows]
    for name in sorted({k for _, t in per_step for k in t}):
        pts = [(s, t[name]) for s, t in per_step if name in t]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name)
    ax.set_title("throughput")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


def _phases(ax, rows: Rows) -> None:
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for name in PHASES:
        values = []
        for r in rows:
            clean = {k: float(v) for k, v in r.items() if v is not None}
            phases = phases_from_metrics(clean)
            if name == "idle" and "idle" not in phases:
                phases["idle"] = max(clean.get("time/step_s", 0.0) - sum(phases.values()), 0.0)
            values.append(phases.get(name, 0.0))
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("phase breakdown (s per step)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)


def plot(rows: Rows, out: Path) -> Path:
    """Draw the dashboard of ``rows`` into ``out`` (PNG); return ``out``."""
    keys = sorted({k for r in rows for k in r})
    multiturn = any(k.startswith("multiturn/") for k in keys)
    fig, axes = plt.subplots(3 if multiturn else 2, 3, figsize=(16, 12.5 if multiturn else 8.5))
    _lines(axes[0, 0], rows, ["rollout/reward_mean"], "reward (mean)")
    _lines(axes[0, 1], rows, [k for k in keys if k.startswith("rollout/") and "response_len" in k], "response length")
    _throughput(axes[0, 2], rows)
    _phases(axes[1, 0], rows)
    _lines(axes[1, 1], rows, [k for k in keys if k.startswith(KL_CLIP_PREFIXES)], "KL / clip fractions")
    _lines(axes[1, 2], rows, ["loss/value", "loss/grad_norm"], "loss and grad norm")
    if multiturn:  # multi-turn runs: a third row (generation.metrics.multiturn_metrics)
        _lines(axes[2, 0], rows, ["multiturn/turns_mean", "multiturn/turns_max"], "turns per trajectory")
        _lines(
            axes[2, 1],
            rows,
            ["multiturn/tool_calls", "multiturn/tool_errors", "multiturn/env_failures"],
            "tool calls / errors / environment failures per step",
        )
        _lines(
            axes[2, 2],
            rows,
            ["multiturn/model_tokens", "multiturn/observation_tokens"],
            "model vs observation tokens per step",
        )
        axes[2, 2].twinx().plot(*series(rows, "multiturn/env_s"), "k:", label="env s")
    for ax in axes.flat:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"megatron_rl run: {len(rows)} steps")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's trainer.log_dir (holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default RUN_DIR/dashboard.png)")
    args = parser.parse_args(argv)
    out = plot(read_metrics(args.run_dir), args.out or args.run_dir / "dashboard.png")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
