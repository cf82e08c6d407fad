"""Simulate SAGC against fixed group sizes on a heavy-tailed rollout workload; print one JSON line.

    python tools/simulate_sagc.py [--steps 4000] [--seed 0] [--delta 0.1] [--tau 3]
                                  [--no-stragglers]

Each policy (SAGC, and fixed G for every SAGC candidate) runs `--steps` steps of `--prompts`
prompts on the workload of `megatron_rl/control/simulation.py`: lognormal response lengths
plus a Pareto runaway tail whose probability grows with G and over the first `ramp_steps`
steps. Wall-clock: a step lasts overhead + decode time of its longest response; each policy's
seconds per generated sample are scaled to the same work budget (what fixed G=max generates in
`--steps` steps), so policies are compared on equal work. Printed per policy: straggler_rate
(whole run), wall_clock_h, mean_g, final_g, late_straggler_rate and late_mean_g (second half of
the steps); then the checks:
  straggler_within_delta   SAGC's straggler rate <= delta + 0.05
  faster_than_fixed_<max>  SAGC's wall-clock < fixed largest G's        (default workload)
  settles_on_largest_g     SAGC uses the largest candidate in every step of the second half
                           (with --no-stragglers)
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from megatron_rl.control.sagc import SAGCSettings
from megatron_rl.control.simulation import (
    CostModel,
    LengthModel,
    PolicyResult,
    compare_policies,
)

SLACK = 0.05  # allowed excess of the long-run straggler rate over delta


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags; SAGC defaults come from SAGCSettings."""
    d = SAGCSettings()
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--steps", type=int, default=4000, help="training steps per policy")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths and of SAGC's sampler")
    p.add_argument("--delta", type=float, default=d.delta, help="target straggler rate")
    p.add_argument("--tau", type=float, default=d.tau, help="straggler threshold, max/median")
    p.add_argument("--gamma", type=float, default=d.gamma, help="posterior forgetting factor")
    p.add_argument("--eta", type=float, default=d.eta, help="dual step size")
    p.add_argument("--lambda-max", type=float, default=d.lambda_max, help="clip of lambda")
    p.add_argument("--no-stragglers", action="store_true", help="remove the runaway tail")
    return p.parse_args(argv)


def _row(result: PolicyResult) -> dict[str, float | int]:
    row = dataclasses.asdict(result)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, print one JSON line, return 0 if every check holds."""
    args = parse_args(argv)
    try:
        settings = SAGCSettings(
            delta=args.delta, tau=args.tau, gamma=args.gamma, eta=args.eta, lambda_max=args.lambda_max, seed=args.seed
        )
    except ValueError as err:  # a bad flag value: report it like argparse does, no traceback
        print(f"simulate_sagc.py: error: {err}", file=sys.stderr)
        return 2
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
        fixed_max = results[f"fixed_{g_max}"]
        checks[f"faster_than_fixed_{g_max}"] = sagc.wall_clock_h < fixed_max.wall_clock_h
    report = {name: _row(r) for name, r in results.items()}
    report.update(delta=args.delta, tau=args.tau, steps=args.steps, checks=checks)
    print(json.dumps(report))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
