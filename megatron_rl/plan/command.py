"""``python -m megatron_rl plan CONFIG [a.b=c ...] --nodes N --devices-per-node D --device KIND``.

Exit status: 0 when the largest pipeline stage fits the device, 1 when it does not (the
report ends with the knobs that would make it fit), 2 when the layout itself is impossible
(the message names the key or flag).
"""

from __future__ import annotations

import argparse
import sys

from megatron_rl.config.schema import Config
from megatron_rl.plan.devices import DEVICES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The plan subcommand's flags."""
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (NNODES)")
    parser.add_argument("--devices-per-node", type=int, default=8, help="accelerators per node")
    parser.add_argument("--device", default="h100", choices=[*DEVICES, "cpu"], help="device kind (memory table)")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="dense bf16 TFLOPS per device for the compute bound (default: the device table's)",
    )


def plan_command(cfg: Config, args: argparse.Namespace) -> int:
    """Print the plan of `cfg`; the exit status is the verdict (see the module docstring)."""
    from megatron_rl.plan.build import build_plan
    from megatron_rl.plan.report import render

    try:
        plan = build_plan(cfg, nodes=args.nodes, devices_per_node=args.devices_per_node, device=args.device)
    except ValueError as err:  # LayoutError, an unsupported architecture, a backend for another device
        print(f"megatron_rl plan: {err}", file=sys.stderr)
        return 2
    print(render(plan, source=args.config, peak_tflops=args.peak_tflops))
    return 0 if plan.fits else 1
