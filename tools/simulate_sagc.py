"""Simulate SAGC against fixed group sizes; print one JSON line (or a table: --format table).

    python tools/simulate_sagc.py [--workload paper|synthetic] [--format json|table]
                                  [--steps N] [--prompts B] [--seed 0] [--delta 0.1] [--tau 3] ...

--workload paper (default): the SAGC paper's setting, megatron_rl/control/workload.py. SAGC and
fixed G for every candidate (4, 8, 16) run the same number of steps on the same length stream;
lengths are lognormal (per-prompt factor, median growing over training, cap), calibrated so that
fixed G = 16 straggles on 99.6 % of steps (paper, Llama-3.2-3B / DAPO), and the time unit so that
fixed G = 16 in sync mode takes the paper's 29.50 h. Printed per pipeline mode (sync: train after
the whole batch is generated; periodic: train each group as it finishes, control/steptime.py)
and per policy: wall_clock_h, straggler_rate, mean_g, signal_per_h (expected informative groups
x log2 G per hour, the paper's utility), informative_groups_per_h, informative_samples_per_h,
signal_total, samples; then `paper` (its four figures) and `vs_paper` (the simulator's
counterparts, and the lowest straggler rate fixed G = 4 can have if G = 16 straggles on 99.6 % of
steps and lengths are independent given the prompt: 1 - (1 - 0.996)^(4/16)). No pass/fail checks:
a benchmark; exit status 0.

--workload synthetic: the earlier scenario (megatron_rl/control/simulation.py: lognormal body,
Pareto runaways whose probability grows as G^1.7) with its checks, exit status 1 if one fails:
  straggler_within_delta   SAGC's straggler rate <= delta + 0.05
  faster_than_fixed_<max>  SAGC's wall-clock < fixed largest G's        (default)
  settles_on_largest_g     SAGC uses the largest candidate in every step of the second half
                           (with --no-stragglers)

--runs DIR [DIR ...]: no simulation; compares real training runs (each DIR a trainer.log_dir with
metrics.jsonl, e.g. SAGC and fixed G on the demo) over the same number of samples: the first
steps of each run up to the smallest run's total of train/responses. Per run: steps, samples,
response_tokens, straggler_rate (mean of control/straggler), mean_g, reward_mean (mean of
rollout/reward_mean), reward_first5, reward_last5, step_s and generation_s (mean seconds per step,
wall-clock: load-dependent on a shared machine), over those steps. A log_dir holding several runs
(steps not increasing: metrics.jsonl is appended to) is refused, exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from megatron_rl.control import workload as wl
from megatron_rl.control.sagc import SAGCSettings
from megatron_rl.control.signal import PassRateModel
from megatron_rl.control.simulation import CostModel, LengthModel, compare_policies
from megatron_rl.control.steptime import StepTimeModel

SLACK = 0.05  # synthetic workload: allowed excess of the long-run straggler rate over delta
DEFAULTS = {
    "paper": {"steps": wl.ASSUMED_STEPS, "prompts": wl.ASSUMED_PROMPTS_PER_STEP},
    "synthetic": {"steps": 4000, "prompts": 8},
}


def _add_sagc_flags(p: argparse.ArgumentParser) -> None:
    """SAGC's own settings, defaults from SAGCSettings."""
    d = SAGCSettings()
    p.add_argument("--delta", type=float, default=d.delta, help="target straggler rate")
    p.add_argument("--tau", type=float, default=d.tau, help="straggler threshold, max/median")
    p.add_argument("--gamma", type=float, default=d.gamma, help="posterior forgetting factor")
    p.add_argument("--eta", type=float, default=d.eta, help="dual step size")
    p.add_argument("--lambda-max", type=float, default=d.lambda_max, help="clip of lambda")


def _add_paper_flags(p: argparse.ArgumentParser) -> None:
    """The paper workload's pass rate and step-time model, defaults from workload.py."""
    p.add_argument(
        "--pass-rate",
        type=float,
        default=wl.ASSUMED_PASS_RATE_MEAN,
        help="paper: mean per-prompt pass rate (Beta, concentration 2)",
    )
    p.add_argument(
        "--decode-iter-s",
        type=float,
        default=wl.ASSUMED_DECODE_ITER_S,
        help="paper: seconds per decode iteration (before calibration)",
    )
    p.add_argument(
        "--decode-seq-s",
        type=float,
        default=wl.ASSUMED_DECODE_SEQ_S,
        help="paper: seconds per running sequence per decode iteration",
    )
    p.add_argument(
        "--train-token-s", type=float, default=wl.ASSUMED_TRAIN_TOKEN_S, help="paper: training seconds per token"
    )
    p.add_argument(
        "--sync-s", type=float, default=wl.ASSUMED_SYNC_S, help="paper: optimizer step + weight sync seconds"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; SAGC defaults come from SAGCSettings, workload ones from workload.py."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--workload", choices=("paper", "synthetic"), default="paper")
    p.add_argument(
        "--format", choices=("json", "table"), default="json", help="one JSON line (default) or a readable table"
    )
    p.add_argument("--steps", type=int, help="training steps per policy (paper 500, synthetic 4000)")
    p.add_argument("--prompts", type=int, help="prompts per step (paper 32, synthetic 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths and of SAGC's sampler")
    _add_sagc_flags(p)
    _add_paper_flags(p)
    p.add_argument("--no-stragglers", action="store_true", help="synthetic: remove the runaway tail")
    p.add_argument(
        "--runs", nargs="+", metavar="DIR", help="compare real runs' metrics.jsonl over the same number of samples"
    )
    args = p.parse_args(argv)
    for name, value in DEFAULTS[args.workload].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def _round(row: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def _paper_workload(args: argparse.Namespace) -> wl.Workload:
    """The paper's workload at the flags' steps, prompts, pass rate and step-time model."""
    return wl.Workload(
        steps=args.steps,
        prompts=args.prompts,
        lengths=wl.ReasoningLengths(ramp_steps=args.steps),
        step_time=StepTimeModel(
            decode_iter_s=args.decode_iter_s,
            decode_seq_s=args.decode_seq_s,
            train_token_s=args.train_token_s,
            sync_s=args.sync_s,
            prompt_tokens=wl.ASSUMED_PROMPT_TOKENS,
        ),
        pass_rates=PassRateModel(mean=args.pass_rate, concentration=wl.ASSUMED_PASS_RATE_CONCENTRATION),
    )


def _paper_comparison(results: dict, g_max: int) -> dict:
    """``paper`` (the paper's four figures) and ``vs_paper`` (the simulator's counterparts)."""
    ratio = {mode: rows["sagc"].wall_clock_h / rows[f"fixed_{g_max}"].wall_clock_h for mode, rows in results.items()}
    paper = {
        "run": "Llama-3.2-3B / DAPO (summary sec. 4)",
        "fixed_16_straggler_rate": wl.PAPER_FIXED_G16_STRAGGLER_RATE,
        "sagc_straggler_rate": wl.PAPER_SAGC_STRAGGLER_RATE,
        "fixed_16_hours": wl.PAPER_FIXED_G16_HOURS,
        "sagc_hours": wl.PAPER_SAGC_HOURS,
        "sagc_over_fixed_16_hours": round(wl.PAPER_SAGC_HOURS / wl.PAPER_FIXED_G16_HOURS, 4),
    }
    vs_paper = _round(
        {
            "fixed_16_straggler_rate": results["sync"][f"fixed_{g_max}"].straggler_rate,
            "sagc_straggler_rate": results["sync"]["sagc"].straggler_rate,
            "sagc_over_fixed_16_hours_sync": ratio["sync"],
            "sagc_over_fixed_16_hours_periodic": ratio["periodic"],
            "min_g4_straggler_rate_if_independent": 1.0 - (1.0 - wl.PAPER_FIXED_G16_STRAGGLER_RATE) ** (4 / 16),
        }
    )
    return {"paper": paper, "vs_paper": vs_paper}


def run_paper(args: argparse.Namespace, settings: SAGCSettings) -> dict:
    """The paper workload: both modes, every policy, and the comparison with the paper."""
    results = wl.compare_on_workload(settings, _paper_workload(args), seed=args.seed)
    report: dict = {"workload": "paper"}
    for mode, rows in results.items():
        report[mode] = {name: _round(dataclasses.asdict(r)) for name, r in rows.items()}
    report.update(_paper_comparison(results, settings.candidates[-1]))
    report["calibrated"] = [  # the calibration holds for the default tau, prompts and lengths
        f"response_sigma {wl.CALIBRATED_RESPONSE_SIGMA}: fixed_16 straggles on the paper's 99.6 % "
        f"of steps at tau 3, {wl.ASSUMED_PROMPTS_PER_STEP} prompts per step",
        "time unit: fixed_16 sync wall-clock = the paper's 29.50 h",
    ]
    report.update(delta=args.delta, tau=args.tau, steps=args.steps, prompts=args.prompts)
    return report


def compare_runs(dirs: list[str]) -> dict:
    """Real runs over the same samples: each run's first whole steps whose total
    stays within the smallest run's total."""
    rows = {d: _read_run(Path(d)) for d in dirs}
    budget = min(sum(r["train/responses"] for r in run) for run in rows.values())
    report: dict = {"workload": "runs", "samples_budget": int(budget)}
    for name, run in rows.items():
        used, done = [], 0.0
        for r in run:  # whole steps while the total stays within the budget (at least one)
            if used and done + r["train/responses"] > budget:
                break
            used.append(r)
            done += r["train/responses"]
        report[name] = _round(_run_figures(used))
    return report


def _read_run(log_dir: Path) -> list[dict]:
    """The step rows of one run's metrics.jsonl; refused when its steps do not increase (the file is
    appended to, so a second run into the same log_dir would be counted as one longer run)."""
    run = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in run]
    if not run or any(b <= a for a, b in itertools.pairwise(steps)):
        raise ValueError(
            f"{log_dir}/metrics.jsonl: no rows, or its steps do not increase "
            "(several runs in one log_dir?); give each run a fresh trainer.log_dir"
        )
    return run


def _run_figures(used: list[dict]) -> dict:
    """Straggler rate, mean G, reward (mean, first 5, last 5 steps), samples, response tokens and
    seconds per step over the steps ``used``."""

    def mean(key: str, part: list[dict] = used) -> float:
        return sum(r[key] for r in part) / len(part)

    return {
        "steps": len(used),
        "samples": int(sum(r["train/responses"] for r in used)),
        "response_tokens": int(sum(r["rollout/response_tokens"] for r in used)),
        "straggler_rate": mean("control/straggler"),
        "mean_g": mean("control/group_size"),
        "reward_mean": mean("rollout/reward_mean"),
        "reward_first5": mean("rollout/reward_mean", used[:5]),
        "reward_last5": mean("rollout/reward_mean", used[-5:]),
        "step_s": mean("time/step_s"),
        "generation_s": mean("time/generation_s"),
    }


def run_synthetic(args: argparse.Namespace, settings: SAGCSettings) -> dict:
    """The earlier synthetic scenario and its checks (report["checks"])."""
    lengths = LengthModel()
    if args.no_stragglers:
        lengths = dataclasses.replace(lengths, tail_prob=0.0)
    results = compare_policies(
        settings=settings, steps=args.steps, prompts=args.prompts, seed=args.seed, lengths=lengths, cost=CostModel()
    )
    sagc, g_max = results["sagc"], settings.candidates[-1]
    checks = {"straggler_within_delta": sagc.straggler_rate <= args.delta + SLACK}
    if args.no_stragglers:
        checks["settles_on_largest_g"] = sagc.late_mean_g == g_max and sagc.final_g == g_max
    else:
        checks[f"faster_than_fixed_{g_max}"] = sagc.wall_clock_h < results[f"fixed_{g_max}"].wall_clock_h
    report: dict = {"workload": "synthetic"}
    report.update({name: _round(dataclasses.asdict(r)) for name, r in results.items()})
    report.update(delta=args.delta, tau=args.tau, steps=args.steps, checks=checks)
    return report


PAPER_COLUMNS = (
    ("wall_clock_h", "wall h", "{:8.2f}"),
    ("straggler_rate", "straggler", "{:9.1%}"),
    ("mean_g", "mean G", "{:6.2f}"),
    ("signal_per_h", "signal/h", "{:8.0f}"),
    ("informative_groups_per_h", "inf.groups/h", "{:12.0f}"),
    ("informative_samples_per_h", "inf.samples/h", "{:13.0f}"),
    ("signal_total", "signal total", "{:12.0f}"),
)


def _runs_table(report: dict) -> str:
    """One row per real run, then the samples budget."""
    names = [k for k in report if isinstance(report[k], dict)]
    lines = [
        f"{'run':32s} {'steps':>5s} {'samples':>7s} {'tokens':>7s} {'straggler':>9s} {'mean G':>6s} "
        f"{'reward':>6s} {'first5':>6s} {'last5':>6s} {'step s':>6s} {'gen s':>6s}"
    ]
    lines += [
        f"{n[-32:]:32s} {r['steps']:5d} {r['samples']:7d} {r['response_tokens']:7d} "
        f"{r['straggler_rate']:9.1%} {r['mean_g']:6.2f} {r['reward_mean']:6.3f} "
        f"{r['reward_first5']:6.3f} {r['reward_last5']:6.3f} {r['step_s']:6.1f} {r['generation_s']:6.1f}"
        for n, r in ((n, report[n]) for n in names)
    ]
    return "\n".join([*lines, f"samples budget: {report['samples_budget']}"])


def _synthetic_table(report: dict) -> str:
    """One row per policy, then the checks."""
    names = [k for k in report if k == "sagc" or k.startswith("fixed_")]
    lines = [f"{'policy':10s} {'wall h':>8s} {'straggler':>9s} {'mean G':>6s}"]
    lines += [
        f"{n:10s} {report[n]['wall_clock_h']:8.2f} {report[n]['straggler_rate']:9.1%} {report[n]['mean_g']:6.2f}"
        for n in names
    ]
    return "\n".join(lines + [f"checks: {report['checks']}"])


def _paper_table(report: dict) -> str:
    """One block per pipeline mode, then the paper's figures against the simulator's."""
    lines = []
    for mode in ("sync", "periodic"):
        head = " ".join(f"{title:>{len(fmt.format(0))}s}" for _, title, fmt in PAPER_COLUMNS)
        lines += [f"[{mode}]", f"{'policy':10s} {head}"]
        for name, row in report[mode].items():
            cells = " ".join(fmt.format(row[key]) for key, _, fmt in PAPER_COLUMNS)
            lines.append(f"{name:10s} {cells}")
    paper, ours = report["paper"], report["vs_paper"]
    lines += [
        f"paper ({paper['run']}): fixed 16 {paper['fixed_16_hours']} h, "
        f"{paper['fixed_16_straggler_rate']:.1%} straggler; SAGC {paper['sagc_hours']} h "
        f"({paper['sagc_over_fixed_16_hours']:.2f} x), {paper['sagc_straggler_rate']:.1%} straggler",
        f"simulator: fixed 16 {ours['fixed_16_straggler_rate']:.1%} (calibrated to 99.6% at tau 3, "
        f"32 prompts per step); SAGC "
        f"{ours['sagc_over_fixed_16_hours_sync']:.2f} x sync, "
        f"{ours['sagc_over_fixed_16_hours_periodic']:.2f} x periodic, "
        f"{ours['sagc_straggler_rate']:.1%} straggler; fixed 4 cannot straggle on fewer than "
        f"{ours['min_g4_straggler_rate_if_independent']:.1%} of steps if lengths are independent "
        f"given the prompt",
    ]
    return "\n".join(lines)


def format_table(report: dict) -> str:
    """Readable table of a report (paper: per mode; synthetic: one block; runs: one row per run)."""
    tables = {"runs": _runs_table, "synthetic": _synthetic_table}
    return tables.get(report["workload"], _paper_table)(report)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen workload, print one JSON line (or a table); exit 1 if a check fails."""
    args = parse_args(argv)
    try:
        if args.runs:
            report = compare_runs(args.runs)
            print(json.dumps(report) if args.format == "json" else format_table(report))
            return 0
        settings = SAGCSettings(
            delta=args.delta, tau=args.tau, gamma=args.gamma, eta=args.eta, lambda_max=args.lambda_max, seed=args.seed
        )
        run = run_paper if args.workload == "paper" else run_synthetic
        report = run(args, settings)
    except ValueError as err:  # a bad flag value or run: report it like argparse does, no traceback
        print(f"simulate_sagc.py: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.format == "json" else format_table(report))
    return 0 if all(report.get("checks", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
