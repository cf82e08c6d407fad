"""``python -m megatron_rl plan CONFIG [a.b=c ...] --nodes N --devices-per-node D --device KIND``.

Exit status: 0 when the largest pipeline stage fits the device, 1 when it does not (the
report ends with the knobs that would make it fit) or when a teacher / judge / reward-model
engine does not fit its device (``model_engines``: the line names the key), 2 when the layout
itself is impossible (the message names the key or flag). ``--json``: one JSON line instead
of the text (layout, largest stage, model engines, verdict).
"""

from __future__ import annotations

import argparse
import json
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
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the text")


def plan_command(cfg: Config, args: argparse.Namespace) -> int:
    """Print the plan of `cfg`; the exit status is the verdict (see the module docstring)."""
    from megatron_rl.plan.build import build_plan
    from megatron_rl.plan.model_engines import engine_lines, fit_problems, model_engines
    from megatron_rl.plan.report import render

    try:
        plan = build_plan(cfg, nodes=args.nodes, devices_per_node=args.devices_per_node, device=args.device)
        engines = model_engines(cfg)
    except ValueError as err:  # LayoutError, an unsupported architecture, a backend for another device
        print(f"megatron_rl plan: {err}", file=sys.stderr)
        return 2
    unfit = fit_problems(engines, plan.device)
    if getattr(args, "json", False):
        print(json.dumps(plan_json(plan, engines, unfit)))
    else:
        text = [render(plan, source=args.config, peak_tflops=args.peak_tflops), *engine_lines(engines)]
        print("\n".join(text + [f"refused: {why}" for why in unfit]))
    return 0 if plan.fits and not unfit else 1


def plan_json(plan, engines, unfit: list[str]) -> dict:
    """``plan --json``: the layout, the largest stage's bytes per device, the model engines, the verdict."""
    from megatron_rl.plan.model_engines import engines_json

    lay = plan.layout
    return {
        "device": plan.device.name,
        "layout": {
            "nodes": lay.nodes,
            "ranks_per_node": list(lay.ranks_per_node),
            "tp": lay.tp,
            "pp": lay.pp,
            "dp": lay.dp,
            "engine_devices": list(lay.engine_devices),
        },  # fmt: skip
        "largest_stage_bytes": plan.worst.total,
        "usable_bytes": plan.device.usable_bytes,
        "model_engines": engines_json(engines),
        "fits": plan.fits and not unfit,
        "refused": list(plan.advice) + unfit,
    }
