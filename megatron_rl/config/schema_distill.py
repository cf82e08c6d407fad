"""The ``distill`` section: on-policy distillation from a teacher (``algorithms.distill``), off by default."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .schema import DType, EngineName


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """A teacher served by engines of its own scores every sampled token; the student is trained on
    the per-token reverse KL to it: alone (``algorithm.loss: distill``) or added to the RL loss."""

    teacher: str | None = None  # the teacher's HF checkpoint dir (same tokenizer as the student); None = off
    coef: float = 1.0  # weight of the reverse-KL term, > 0 (with algorithm.loss distill: its scale)
    engine: EngineName = "hf"  # the teacher's engines: hf, or vllm (scores at algorithm.temperature 1 only)
    num_engines: int = 1  # teacher engine processes
    # one device string per teacher engine ("cuda:4", "npu:6,7" at TP 2), apart from rollout.devices;
    # empty: unpinned CPU engines
    devices: list[str] = field(default_factory=list)
    tensor_parallel_size: int = 1  # TP inside each teacher engine (vllm)
    dtype: DType | None = None  # the teacher's weights and compute dtype; None = model.dtype
    max_batch_size: int = 256  # sequences one teacher engine scores at once
    concurrency: int = 2  # completed groups scored at once (in flight to the teacher while generation runs)
    vllm: dict[str, Any] = field(default_factory=dict)  # pass-through vLLM engine kwargs (engine vllm)
