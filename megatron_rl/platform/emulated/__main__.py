"""``python -m megatron_rl.platform.emulated --build``: compile the emulated device's extension now
(``make install`` does, so that test ranks never compile it concurrently); ``--where`` prints
its build folder."""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.platform.emulated", description=__doc__)
    parser.add_argument("--build", action="store_true", help="build the C++ extension if needed")
    parser.add_argument("--where", action="store_true", help="print the build folder")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    from megatron_rl.platform.emulated.build import build_dir, load_extension

    if args.where:
        print(build_dir())
    if args.build:
        start = time.perf_counter()
        load_extension(verbose=args.verbose)
        print(f"emulated device extension ready in {build_dir()} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
