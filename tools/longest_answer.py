"""The longest answer a device fits per `plan`, at each context-parallel size: one JSON line.

    python tools/longest_answer.py examples/recipes/qwen3-8b-longcot-cp4-910b/config.yaml \
        --nodes 2 --devices-per-node 8 --device 910b --cp 1,4 [a.b=c ...]

For each CP size the config is planned with ``parallel.cp`` = that size, answers of L tokens and
``pipeline.micro_batch_tokens`` = ``data.max_prompt_tokens`` + L (one prompt and one answer per
micro-batch), everything else as configured; L is the largest that fits
(`megatron_rl.plan.longest`). Prints
``{"metric": "longest_answer_tokens", ..., "longest_answer_tokens": {"1": L1, "4": L4}}``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, load the config, print the JSON line."""
    from megatron_rl.config import load_config
    from megatron_rl.plan.devices import DEVICES
    from megatron_rl.plan.longest import longest_answer_json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--device", default="910b", choices=list(DEVICES))
    parser.add_argument("--cp", default="1,4", help="comma-separated parallel.cp sizes (default 1,4)")
    args = parser.parse_args(argv)
    cps = [int(c) for c in args.cp.split(",") if c.strip()]
    if not cps or min(cps) < 1:
        parser.error(f"--cp {args.cp!r}: give CP sizes >= 1, e.g. 1,4")
    cfg = load_config(args.config, args.overrides)
    where = dict(nodes=args.nodes, devices_per_node=args.devices_per_node, device=args.device)
    try:
        print(longest_answer_json(cfg, cps, source=args.config, **where))
    except ValueError as err:  # a CP size the layout cannot take: the message names the key
        print(f"longest_answer: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
