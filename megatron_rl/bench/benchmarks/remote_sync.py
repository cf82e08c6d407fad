"""Seconds and GB/s of one ``broadcast`` weight sync against the number of engine nodes.

    python -m megatron_rl bench remote_sync [--model .cache/models/smollm2-135m-instruct] [--big 7b|3b|tiny|none]

Layouts (one machine standing in for two nodes: node 1's engine runs in an engine host,
``rollout.engine_host``, reached over TCP by the pool's ``rollout.remote.EngineHub``, exactly as on a
cluster, with the sync group over loopback gloo):

    node0     1 engine on node 0 (rank 0's own worker)
    node1     1 engine on node 1 only
    node0+1   2 engines, one per node (the broadcast reaches both)

For each: the demo model's tensors (SmolLM2-135M, fp32, 0.54 GB) into ``hf`` engines (receive
+ in-place load), and the 7B-shaped bf16 set of the ``weight_sync`` benchmark (15.2 GB) into workers
that only receive (``SinkBackend``), through the ``broadcast`` transport's own sender, built
once as the trainer builds it; the first sync is not timed. Prints one JSON line:
``{"demo": {layout: {"s", "gb_per_s", "gb"}}, "big": {...}, "engine_nodes": {layout: n},
"bucket_mb", "cores", "loadavg_start", "loadavg_end"}``; ``gb_per_s`` is model bytes per second
of the whole sync (every engine holds the new weights at the end).
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

LAYOUTS = {"node0": (0,), "node1": (1,), "node0+1": (0, 1)}  # the node of each engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: model, layouts, syncs, bucket size, the big tensor set."""
    p.add_argument("--model", default=".cache/models/smollm2-135m-instruct")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--syncs", type=int, default=3, help="syncs per layout (the first is warm-up)")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--big", default="7b", choices=["7b", "3b", "tiny", "none"])


def start_pool(specs):
    """A ``WorkerPool`` of ``specs``; those with ``node > 0`` served by an engine host thread."""
    from megatron_rl.rollout import WorkerPool
    from megatron_rl.rollout.engine_host import serve
    from megatron_rl.rollout.remote import EngineHub

    port, remote = _free_port(), [s for s in specs if s.node]
    hosts = (
        [threading.Thread(target=serve, args=(remote, ("127.0.0.1", port)), kwargs={"timeout_s": 300}, daemon=True)]
        if remote
        else []
    )
    for h in hosts:
        h.start()
    hub = EngineHub("127.0.0.1", port) if remote else None
    return WorkerPool(specs, max_batch_size=1, start_timeout_s=300, request_timeout_s=600, remote=hub)


def time_layout(specs, tensors, bucket_mb: int, syncs: int) -> float:
    """Median seconds of ``syncs - 1`` broadcast syncs of ``tensors`` into a pool of ``specs``."""
    from megatron_rl.weight_sync import SenderSetup, TensorSource, build_sender

    pool = start_pool(specs)
    try:
        sender = build_sender(
            "broadcast", SenderSetup(source=TensorSource(tensors), engine=pool, bucket_bytes=bucket_mb << 20)
        )
        seconds = []
        for version in range(1, syncs + 1):
            tensors[0][1].add_(1e-3)
            start = time.perf_counter()
            sender.sync(version)
            seconds.append(time.perf_counter() - start)
    finally:
        pool.shutdown()
    rest = sorted(seconds[1:] or seconds)
    return rest[len(rest) // 2]


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(specs_of, tensors, args) -> dict:
    """Per layout: median seconds and GB/s of syncing ``tensors`` into the pool of ``specs_of``."""
    gb = sum(t.nbytes for _, t in tensors) / 1e9
    out = {}
    for layout in args.layouts.split(","):
        s = time_layout(specs_of(LAYOUTS[layout]), tensors, args.bucket_mb, args.syncs)
        out[layout] = {"s": round(s, 3), "gb_per_s": round(gb / s, 3), "gb": round(gb, 3)}
    return out


def run(args: argparse.Namespace) -> dict:
    """Every layout with the demo model, then with the big set; the figures."""
    from safetensors.torch import load_file

    from megatron_rl.bench.benchmarks.weight_sync import SINK_BACKEND, _settings, qwen2_tensors
    from megatron_rl.rollout.build import worker_specs

    (base,) = worker_specs(_settings("hf", args.model))

    def specs_of(nodes, backend=base.backend):
        return [replace(base, index=i, node=n, backend=backend) for i, n in enumerate(nodes)]

    result = {
        "bucket_mb": args.bucket_mb,
        "cores": len(os.sched_getaffinity(0)),
        "loadavg_start": os.getloadavg()[0],
        "engine_nodes": {k: len(set(v)) for k, v in LAYOUTS.items()},
    }
    demo = sorted(load_file(str(Path(args.model) / "model.safetensors")).items())
    result["demo"] = bench(specs_of, demo, args)
    if args.big != "none":
        sink = SINK_BACKEND
        result["big"] = {
            "shape": f"qwen2.5-{args.big}",
            "dtype": "bfloat16",
            **bench(lambda nodes: specs_of(nodes, sink), qwen2_tensors(args.big), args),
        }
    result["loadavg_end"] = os.getloadavg()[0]
    return result
