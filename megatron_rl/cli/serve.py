"""``python -m megatron_rl serve CONFIG --node-rank N``: run the engines ``rollout.engine_nodes``
places on node N, for the dispatcher on global rank 0 (the host itself: ``rollout.engine_host``).

The command reads the run's config into engine settings (``trainer.from_config``), which is why
it lives on the command-line side and not beside the host.
"""

from __future__ import annotations

import os

from megatron_rl.rollout.engine_host import NODE_ADDR_VAR, serve
from megatron_rl.rollout.worker import WorkerSpec


def add_arguments(parser) -> None:
    """The ``serve`` command's flags."""
    parser.add_argument("--node-rank", type=int, required=True, help="this node's rank (rollout.engine_nodes)")
    parser.add_argument(
        "--connect",
        default=None,
        help="HOST:PORT of rank 0's engine hub (default: rollout.sync_address:rollout.engine_port)",
    )
    parser.add_argument(
        "--chaos-crash",
        type=float,
        default=0.0,
        help="chaos runs: probability that a worker "
        "exits before answering a request (seeded, once per request id; rollout.faults)",
    )
    parser.add_argument("--chaos-seed", type=int, default=0)
    parser.add_argument("--chaos-dir", default=None, help="marker directory of the fired faults (chaos runs)")
    parser.add_argument(
        "--address",
        default=None,
        help="this node's address on the cluster network (the weight "
        "sync groups bind to it; default: the hub's host, right on one machine)",
    )


def serve_command(cfg, args) -> int:
    """``python -m megatron_rl serve CONFIG --node-rank N``: run node N's engines until the run ends."""
    from megatron_rl.rollout.build import worker_specs
    from megatron_rl.trainer.from_config import engine_settings

    r = cfg.rollout
    host, port = args.connect.rsplit(":", 1) if args.connect else (r.sync_address, r.engine_port)
    if args.address:
        os.environ[NODE_ADDR_VAR] = args.address  # inherited by the worker processes
    specs = [s for s in worker_specs(engine_settings(cfg)) if s.node == args.node_rank]
    wrap = None
    if args.chaos_crash > 0:
        from megatron_rl.rollout.faults import with_faults

        def wrap(spec: WorkerSpec) -> WorkerSpec:
            return with_faults(
                [spec],
                hang=0.0,
                crash=args.chaos_crash,
                seed=args.chaos_seed,
                marker_dir=args.chaos_dir or "/tmp/megatron_rl_chaos",
            )[0]

    return serve(specs, (host, int(port)), timeout_s=r.start_timeout_s, wrap=wrap)
