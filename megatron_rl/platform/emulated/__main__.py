"""``python -m megatron_rl.platform.emulated --build``: compile the emulated device's extension now
(``make install`` does, so that test ranks never compile it concurrently); ``--where`` prints
its build folder; ``--rules npu`` prints a profile's rule table with the source of each rule."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.platform.emulated", description=__doc__)
    parser.add_argument("--build", action="store_true", help="build the C++ extension if needed")
    parser.add_argument("--where", action="store_true", help="print the build folder")
    parser.add_argument("--rules", choices=("cuda", "npu"), help="print this profile's rules and their sources")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    from megatron_rl.platform.emulated.build import build_dir, load_extension

    if args.rules:
        print(rules_table(args.rules))
    if args.where:
        print(build_dir())
    if args.build:
        start = time.perf_counter()
        load_extension(verbose=args.verbose)
        print(f"emulated device extension ready in {build_dir()} ({time.perf_counter() - start:.1f} s)")
    return 0


def rules_table(name: str) -> str:
    """One line per rule of profile ``name``: its kind, what it says, and its source."""
    import dataclasses

    from megatron_rl.platform.emulated.profiles import PROFILES

    profile, lines = PROFILES[name], []
    for field in dataclasses.fields(PROFILES[name]):
        value = getattr(profile, field.name)
        for rule in value if isinstance(value, tuple) else (value,):
            if not dataclasses.is_dataclass(rule):
                continue
            said = {k: v for k, v in dataclasses.asdict(rule).items() if k != "source"}
            lines.append(f"{type(rule).__name__}: {said}\n    source: {rule.source}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
