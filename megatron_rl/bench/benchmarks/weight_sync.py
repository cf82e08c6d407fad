"""Seconds and GB/s of one weight sync, trainer process -> engine worker processes.

    python -m megatron_rl bench weight_sync [--model .cache/models/smollm2-135m-instruct] [--big 7b|3b|none]

Demo model (SmolLM2-135M, fp32, ~0.54 GB): for each engine (``hf``, ``vllm`` when installed)
and each ``rollout.weight_sync`` transport (``megatron_rl.weight_sync.TRANSPORTS``), ``--syncs``
syncs of perturbed HF tensors into one worker by that transport's own sender, built once as
the trainer builds it, over what the trainer's HF export yields (snapshot: write the
safetensors snapshot to /dev/shm + the worker loads it; broadcast: flat buckets of
``--bucket-mb`` over the gloo group + load; shared_memory: write the /dev/shm weights file +
the worker copies from it), the first not timed. Then a 7B-size synthetic tensor set
(Qwen2.5-7B shapes, bf16, ~15.2 GB) through the bucketed broadcast path into a worker whose
backend only receives (``SinkBackend``: transfer alone, no engine). Its tensors are views of
one random bf16 buffer the size of the largest tensor, so the sender needs ~1 GB, not 15
(every byte is still packed and sent).

Prints one JSON line: ``{"demo": {"hf": {"snapshot": {"s", "best_s", "gb_per_s", "cpu_s"},
"broadcast": ..., "shared_memory": ...}, "vllm": ...}, "big": {"shape", "gb", "s", "gb_per_s"},
"bucket_mb", "cores", "loadavg_start", "loadavg_end"}``; s is the median per-sync wall time,
cpu_s the median CPU seconds of the trainer process and the worker together (on a machine
shared with other jobs, the wall time grows with the load average; the CPU time does not).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

# (hidden, intermediate, layers, heads, kv heads, vocab, tied) of the synthetic big models.
SHAPES = {
    "7b": (3584, 18944, 28, 28, 4, 152064, False),  # Qwen2.5-7B
    "3b": (2048, 11008, 36, 16, 2, 151936, True),  # Qwen2.5-3B
    "tiny": (64, 128, 2, 2, 1, 300, False),  # for the tool's own test
}


SINK_BACKEND = f"{__name__}:SinkBackend"  # the worker backend path of ``SinkBackend``


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: model, engines, syncs, bucket size, the big tensor set."""
    p.add_argument("--model", default=".cache/models/smollm2-135m-instruct")
    p.add_argument("--engines", default="hf,vllm", help="comma-separated ('' for none); vllm is skipped if absent")
    p.add_argument("--syncs", type=int, default=4, help="syncs per path (the first is warm-up)")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--big", default="7b", choices=[*SHAPES, "none"])
    p.add_argument("--big-syncs", type=int, default=2)


def qwen2_tensors(shape: str) -> list[tuple[str, torch.Tensor]]:
    """HF-named bf16 tensors of a Qwen2 model of ``shape``, views of one random buffer."""
    h, ffn, layers, heads, kv, vocab, tied = SHAPES[shape]
    kv_dim = h // heads * kv
    per_layer = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.q_proj.bias": (h,),
        "self_attn.k_proj.weight": (kv_dim, h),
        "self_attn.k_proj.bias": (kv_dim,),
        "self_attn.v_proj.weight": (kv_dim, h),
        "self_attn.v_proj.bias": (kv_dim,),
        "self_attn.o_proj.weight": (h, h),
        "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h),
        "mlp.down_proj.weight": (h, ffn),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    shapes = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": s for k, s in per_layer.items()})
    shapes["model.norm.weight"] = (h,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    pool = torch.randn(vocab * h, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    return [(n, pool[: _numel(s)].view(s)) for n, s in shapes.items()]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class SinkBackend:
    """A worker backend that only receives: every tensor is read once (a checksum) and dropped."""

    streams_weights = True

    def __init__(self, spec) -> None:
        self.checksum = 0.0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def load_tensors(self, named_tensors) -> None:
        for _, t in named_tensors:
            self.checksum += float(t.view(-1)[:1].float().sum())

    def generate(self, requests, weight_version):
        raise NotImplementedError


def _settings(engine: str, model_path: str, **extra):
    from megatron_rl.rollout import EngineSettings

    return EngineSettings(
        engine=engine, model_path=model_path, dtype="float32", num_engines=1, max_batch_size=4, **extra
    )


def _sender(engine, transport: str, tensors, scratch: Path, bucket_mb: int):
    from megatron_rl.weight_sync import SenderSetup, TensorSource, build_sender

    return build_sender(
        transport,
        SenderSetup(source=TensorSource(tensors), engine=engine, scratch=scratch, bucket_bytes=bucket_mb << 20),
    )


def cpu_seconds(pids) -> float:
    """CPU seconds (user + system) used so far by this process and the processes ``pids``."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return total


def time_syncs(engine, tensors, sender, syncs: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of ``syncs`` syncs by ``sender`` (the first dropped), perturbed
    tensors each time; CPU counts the trainer process and the workers (the machine may be
    shared: CPU seconds are the cost, wall seconds what a user waits)."""
    out = []
    first = engine.weight_version + 1  # one engine serves every transport: versions continue
    for version in range(first, first + syncs):
        for _, t in tensors[:4]:
            t.add_(1e-3)  # new weights every version (a few tensors suffice: the path moves all)
        pids = [s.pid for s in engine.status()]
        start, cpu = time.perf_counter(), cpu_seconds(pids)
        sender.sync(version)
        out.append((time.perf_counter() - start, cpu_seconds(pids) - cpu))
    return out[1:]


def bench_demo(args, engine_name: str) -> dict:
    """Per transport: median and best seconds, GB/s and CPU seconds of syncing the demo model."""
    from safetensors.torch import load_file

    from megatron_rl.rollout import build_engine
    from megatron_rl.weight_sync import TRANSPORTS

    tensors = sorted(load_file(str(Path(args.model) / "model.safetensors")).items())
    gb = sum(t.nbytes for _, t in tensors) / 1e9
    out = {}
    engine = build_engine(_settings(engine_name, args.model))  # one pool takes every transport
    try:
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
            timings_of = {
                sync: time_syncs(
                    engine, tensors, _sender(engine, sync, tensors, Path(root), args.bucket_mb), args.syncs
                )
                for sync in TRANSPORTS
            }
    finally:
        engine.shutdown()
    for sync, timings in timings_of.items():
        s, cpu = statistics.median(t[0] for t in timings), statistics.median(t[1] for t in timings)
        out[sync] = {
            "s": round(s, 4),
            "gb_per_s": round(gb / s, 3),
            "cpu_s": round(cpu, 4),
            "gb": round(gb, 3),
            "best_s": round(min(t[0] for t in timings), 4),
        }
    return out


def bench_big(args) -> dict:
    """Seconds and GB/s of the big synthetic set's bucketed broadcast into a receive-only worker."""
    from megatron_rl.rollout import WorkerPool
    from megatron_rl.rollout.build import worker_specs

    tensors = qwen2_tensors(args.big)
    gb = sum(t.nbytes for _, t in tensors) / 1e9
    (spec,) = worker_specs(_settings("hf", args.model))
    from dataclasses import replace

    pool = WorkerPool([replace(spec, backend=SINK_BACKEND)], max_batch_size=1)
    try:
        sender, seconds = _sender(pool, "broadcast", tensors, Path(tempfile.gettempdir()), args.bucket_mb), []
        for version in range(1, args.big_syncs + 1):
            start = time.perf_counter()
            sender.sync(version)
            seconds.append(time.perf_counter() - start)
    finally:
        pool.shutdown()
    s = min(seconds)
    shape = args.big if args.big == "tiny" else f"qwen2.5-{args.big}"
    return {
        "shape": shape,
        "dtype": "bfloat16",
        "gb": round(gb, 2),
        "s": round(s, 3),
        "gb_per_s": round(gb / s, 3),
        "all_s": [round(x, 3) for x in seconds],
    }


def run(args: argparse.Namespace) -> dict:
    """Every engine's every transport on the demo model, then the big set; the figures."""
    result = {
        "bucket_mb": args.bucket_mb,
        "cores": len(os.sched_getaffinity(0)),
        "demo": {},
        "loadavg_start": os.getloadavg()[0],
    }
    for engine in filter(None, args.engines.split(",")):
        if engine == "vllm" and importlib.util.find_spec("vllm") is None:
            result["demo"][engine] = "not installed"
            continue
        result["demo"][engine] = bench_demo(args, engine)
    if args.big != "none":
        result["big"] = bench_big(args)
    result["loadavg_end"] = os.getloadavg()[0]
    return result
