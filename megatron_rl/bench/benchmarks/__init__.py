"""The named benchmarks of ``python -m megatron_rl bench <name>``: one module each, every one
exposing ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> dict`` (the shared runner
prints the dict as one JSON line)."""
