"""A model-free worker backend that injects faults, for the rollout supervision tests.

``EchoBackend`` answers request r with ``response_ids = (sum(prompt) + seed + i) % 97`` for
i < max_new_tokens (deterministic, no model), after ``FAULT_DELAY_S`` seconds per request.
Faults are chosen by the worker's environment (``WorkerSpec.env``):

    FAULT_HANG_ON=<request id>   sleep forever when that request comes up
    FAULT_CRASH_ON=<request id>  exit the process (code 3) when that request comes up
    FAULT_HANG_LOAD=1            sleep forever in load_tensors (after receiving)
    FAULT_HANG_DEVICE=1          sleep forever when asked for its device (before a broadcast)
    FAULT_ONCE_DIR=<dir>         fire each fault once per run (a marker file per fault), so
                                 the restarted worker gets through; unset: fire every time
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from megatron_rl.rollout import DeviceAssignment, GenerationResult
from megatron_rl.rollout.worker import WorkerSpec

FAULT_DELAY_S = 0.02
BACKEND = "tests.rollout_faults:EchoBackend"


def echo_response(prompt_ids, max_new_tokens: int, seed: int = 0) -> tuple[int, ...]:
    return tuple((sum(prompt_ids) + seed + i) % 97 for i in range(max_new_tokens))


def _fire(fault: str) -> bool:
    once = os.environ.get("FAULT_ONCE_DIR")
    if once is None:
        return True
    try:  # O_EXCL: of several workers racing for the same fault, exactly one fires it
        os.close(os.open(Path(once) / fault, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def _maybe_fault(request_id: str) -> None:
    if request_id == os.environ.get("FAULT_HANG_ON") and _fire(f"hang-{request_id}"):
        time.sleep(10_000)
    if request_id == os.environ.get("FAULT_CRASH_ON") and _fire(f"crash-{request_id}"):
        os._exit(3)


class EchoBackend:
    """``WorkerBackend`` without a model (see module doc)."""

    def __init__(self, spec: WorkerSpec):
        self.loads = 0

    @property
    def device(self) -> torch.device:
        if os.environ.get("FAULT_HANG_DEVICE") and _fire("hang-device"):
            time.sleep(10_000)
        return torch.device("cpu")

    def load_tensors(self, named_tensors) -> None:
        for _ in named_tensors:
            pass
        self._maybe_hang_load()

    def _maybe_hang_load(self) -> None:
        if os.environ.get("FAULT_HANG_LOAD") and _fire("hang-load"):
            time.sleep(10_000)

    def generate(self, requests, weight_version: int):
        for r in requests:
            _maybe_fault(r.request_id)
            time.sleep(FAULT_DELAY_S)
            response = echo_response(r.prompt_ids, r.sampling.max_new_tokens, r.sampling.seed or 0)
            yield GenerationResult(
                request_id=r.request_id,
                prompt_ids=r.prompt_ids,
                response_ids=response,
                logprobs=(-1.0,) * len(response),
                finish_reason="length",
                weight_version=weight_version,
            )


def echo_specs(tmp_path, n: int, **env: str) -> list[WorkerSpec]:
    """``n`` CPU worker specs running ``EchoBackend`` with the fault variables ``env``."""
    return [
        WorkerSpec(
            index=i, backend=BACKEND, model_path=str(tmp_path), device=DeviceAssignment(kind="cpu"), env=dict(env)
        )
        for i in range(n)
    ]
