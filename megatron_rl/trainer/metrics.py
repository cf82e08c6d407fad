"""Per-step metrics: one JSON line per step in ``<log_dir>/metrics.jsonl`` and TensorBoard scalars.

Only global rank 0 writes. Values are plain floats keyed by ``group/name`` (``loss/…``,
``rollout/…``, ``control/…``, ``trimodel/…``, ``time/…``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist


class MetricsLogger:
    """Writes step metrics to JSONL and TensorBoard (rank 0); a no-op elsewhere."""

    def __init__(self, log_dir: str | Path | None) -> None:
        self.enabled = log_dir is not None and (not dist.is_initialized() or dist.get_rank() == 0)
        self._file = None
        self._tb = None
        if self.enabled:
            path = Path(log_dir)
            path.mkdir(parents=True, exist_ok=True)
            self._file = open(path / "metrics.jsonl", "a")  # noqa: SIM115 (closed in close())
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(path / "tensorboard"))

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` for ``step`` (non-finite values are kept in JSON as null)."""
        if not self.enabled:
            return
        clean = {k: (float(v) if math.isfinite(float(v)) else None) for k, v in metrics.items()}
        self._file.write(json.dumps({"step": step, **clean}) + "\n")
        self._file.flush()
        for key, value in clean.items():
            if value is not None:
                self._tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._tb.close()
            self._file = self._tb = None
