"""The command line: `python -m megatron_rl train | replay | check-config | plan | bench | serve`.

``python -m megatron_rl train CONFIG.yaml [a.b.c=value ...]``; ``serve`` (a node's engine host)
is ``cli.serve``. Launch one process per training rank with ``torchrun`` (or ``msrun`` on
Ascend); a single process is fine for ``tp = pp = 1``. Config errors are reported before
anything starts.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, load and validate the config, run the command; the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # a named benchmark (or --list) takes no config: its own flags
        from megatron_rl.bench.benchmarks import bench_main, is_benchmark_command

        if is_benchmark_command(argv[1:]):
            return bench_main(argv[1:])
    args = _parse_args(argv)
    # megatron-core warns at import that Apex / Transformer Engine are absent (expected off CUDA).
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed")

    from megatron_rl.config import ConfigError, load_config

    try:
        # check-config and train also check the data file, the tokenizer and the dotted paths
        files = args.command == "train" or (args.command == "check-config" and not args.no_files)
        cfg = load_config(args.config, args.overrides, resources=files)
    except ConfigError as err:
        print(f"megatron_rl: invalid config:\n{err}", file=sys.stderr)
        return 2
    return _run(cfg, args)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command and its flags; ``a.b=c`` overrides may also follow the flags."""
    parser = argparse.ArgumentParser(prog="megatron_rl", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(sub)
    _add_tool_commands(sub)
    args, extra = parser.parse_known_args(argv)
    if unknown := [a for a in extra if a.startswith("-") or "=" not in a]:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides += extra
    return args


def _add_run_commands(sub) -> None:
    """``train`` (and ``--rollout-only``) and ``replay``."""
    from megatron_rl.platform.device import PLATFORMS

    train = sub.add_parser("train", help="run RL training from a YAML config")
    train.add_argument("config", help="YAML config file (see examples/)")
    train.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    train.add_argument("--platform", default="auto", choices=PLATFORMS)
    train.add_argument(
        "--rollout-only",
        action="store_true",
        help="generate and score trainer.steps batches without training (rollout.record saves them)",
    )
    replay = sub.add_parser("replay", help="train on the groups a run recorded with rollout.record (no engine)")
    replay.add_argument("config", help="YAML config file (the recording run's, or a variant)")
    replay.add_argument("recording", help="JSONL written by rollout.record")
    replay.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    replay.add_argument("--platform", default="auto", choices=PLATFORMS)


def _add_tool_commands(sub) -> None:
    """``bench``, ``plan``, ``serve`` and ``check-config``, each with its module's flags."""
    from megatron_rl.bench.options import add_arguments as add_bench_arguments
    from megatron_rl.cli.serve import add_arguments as add_serve_arguments
    from megatron_rl.plan.command import add_arguments as add_plan_arguments

    for name, help_, config_help, add in (
        (
            "bench",
            "measure throughput: e2e loop, trainer alone or engines alone (JSON line); "
            "'bench <name> [args]' runs a named benchmark, 'bench --list' names them",
            "YAML config file (see examples/)",
            add_bench_arguments,
        ),
        (
            "plan",
            "print ranks, engines and memory per training device; refuse what does not fit",
            "YAML config file (see examples/recipes/)",
            add_plan_arguments,
        ),
        (
            "serve",
            "run this node's rollout engines for the dispatcher on global rank 0",
            "YAML config file (the training run's)",
            add_serve_arguments,
        ),
    ):
        command = sub.add_parser(name, help=help_)
        command.add_argument("config", help=config_help)
        command.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
        add(command)
    check = sub.add_parser("check-config", help="load and validate a config, print it resolved")
    check.add_argument("config")
    check.add_argument("overrides", nargs="*")
    check.add_argument(
        "--no-files",
        action="store_true",
        help="skip the data file, tokenizer and dotted-path checks (e.g. a recipe whose model "
        "and data live on the cluster)",
    )


def _run(cfg, args: argparse.Namespace) -> int:
    """Run the parsed command on the validated config."""
    if args.command == "check-config":
        import yaml

        from megatron_rl.config import config_to_dict

        print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        return 0
    if args.command in ("serve", "plan", "bench"):
        module, function = {
            "serve": ("megatron_rl.cli.serve", "serve_command"),
            "plan": ("megatron_rl.plan.command", "plan_command"),
            "bench": ("megatron_rl.bench.runner", "bench_command"),
        }[args.command]
        return getattr(importlib.import_module(module), function)(cfg, args)
    if args.command == "train" and args.rollout_only:
        from megatron_rl.trainer.rollout_only import generate_only

        generate_only(cfg)
        return 0
    from megatron_rl.trainer.loop import train as run_training

    run_training(cfg, platform=args.platform, replay=args.recording if args.command == "replay" else None)
    return 0
