"""Seeded fault injection inside engine workers, for chaos runs and tests (never on by default).

A worker whose spec names ``FAULTY_BACKEND`` wraps the real backend (``inner``: a key of
``BACKEND_CLASSES`` or "pkg.mod:Class") and, for each request, draws from a hash of
(seed, request id) whether to

    hang   sleep forever before answering it (found by rollout.request_timeout_s), or
    crash  exit the process (code 3) before answering it (found by its sentinel).

Contract: each fault fires at most once per request id and run (an O_EXCL marker file in
``marker_dir``, shared by all workers and their restarts), so the re-issued request goes
through: faults change timing and restart counts, never results. The same seed and request
ids give the same faults. Weight loads and broadcasts are never faulted.

    specs = with_faults(worker_specs(settings), hang=0.05, crash=0.05, seed=1, marker_dir=tmp)
    engine = WorkerPool(specs, max_batch_size=..., request_timeout_s=10.0)
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from megatron_rl.rollout.types import GenerationRequest, GenerationResult
from megatron_rl.rollout.worker import WorkerSpec, build_backend

FAULTY_BACKEND = "megatron_rl.rollout.faults:FaultyBackend"
_ENV = "MEGATRON_RL_FAULTS"  # "inner|hang|crash|seed|marker_dir"


def with_faults(
    specs: Sequence[WorkerSpec], *, hang: float, crash: float, seed: int, marker_dir: str | Path
) -> list[WorkerSpec]:
    """``specs`` running ``FaultyBackend`` around their own backend (probabilities per request)."""
    if not (0 <= hang <= 1 and 0 <= crash <= 1 and hang + crash <= 1):
        raise ValueError(f"fault probabilities hang={hang}, crash={crash} must be in [0, 1] with a sum <= 1")
    Path(marker_dir).mkdir(parents=True, exist_ok=True)
    return [
        replace(s, backend=FAULTY_BACKEND, env={**s.env, _ENV: f"{s.backend}|{hang}|{crash}|{seed}|{marker_dir}"})
        for s in specs
    ]


def draw(seed: int, request_id: str) -> float:
    """A uniform number in [0, 1) fixed by (seed, request id)."""
    digest = hashlib.sha256(f"{seed}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class FaultyBackend:
    """``WorkerBackend`` injecting seeded hangs and crashes around the inner backend."""

    def __init__(self, spec: WorkerSpec):
        inner, hang, crash, seed, marker_dir = os.environ[_ENV].split("|")
        self._inner = build_backend(replace(spec, backend=inner))
        self._hang, self._crash, self._seed = float(hang), float(crash), int(seed)
        self._markers = Path(marker_dir)

    @property
    def device(self):
        return self._inner.device

    def load_tensors(self, named_tensors) -> None:
        self._inner.load_tensors(named_tensors)

    def generate(self, requests: Sequence[GenerationRequest], weight_version: int) -> Iterator[GenerationResult]:
        for r in requests:
            self._maybe_fail(r.request_id)
        yield from self._inner.generate(requests, weight_version)

    def _maybe_fail(self, request_id: str) -> None:
        u = draw(self._seed, request_id)
        kind = "hang" if u < self._hang else "crash" if u < self._hang + self._crash else None
        if kind is None or not self._first_time(kind, request_id):
            return
        if kind == "crash":
            os._exit(3)
        time.sleep(10**6)

    def _first_time(self, kind: str, request_id: str) -> bool:
        name = hashlib.sha256(f"{kind}/{request_id}".encode()).hexdigest()[:32]
        try:
            os.close(os.open(self._markers / name, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True
