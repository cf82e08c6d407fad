"""What a check is given (``CheckOptions``) and what it returns: a dict with ``status``
(``pass`` | ``fail`` | ``skip``), its figures, and on failure ``error`` (type, message, last
frame) or ``reasons`` (the thresholds it missed)."""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class CheckOptions:
    """The parts of the command line a check reads; travels to the child process as JSON."""

    device: str  # cuda | npu | cpu | emulated | emulated-npu
    quick: bool  # tiny attention shapes (always on cpu / emulated)
    workdir: str  # models, configs, checkpoints and logs of this run
    overrides: tuple[str, ...] = ()  # --set a.b=c: applied to every RL check's YAML, in order

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CheckOptions:
        fields = json.loads(text)
        return cls(**{**fields, "overrides": tuple(fields.get("overrides", ()))})

    @property
    def emulated(self) -> bool:
        """The emulated device, under either profile (``emulated``: CUDA's rules; ``emulated-npu``: the 910B's)."""
        return self.device in ("emulated", "emulated-npu")

    @property
    def accelerator(self) -> bool:
        """A real GPU or NPU (devices to count, engines pinned to them)."""
        return self.device in ("cuda", "npu")

    @property
    def work(self) -> Path:
        return Path(self.workdir)


def error_record(exc: BaseException) -> dict:
    """Type, message and the innermost frame (``file:line in function``) of ``exc``."""
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    where = f"{last.filename}:{last.lineno} in {last.name}: {(last.line or '').strip()}" if last else None
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "last_frame": where}


def failed(exc: BaseException, **figures) -> dict:
    """The result of a check that raised."""
    return {"status": "fail", **figures, "error": error_record(exc)}


def skipped(reason: str, **figures) -> dict:
    return {"status": "skip", "reason": reason, **figures}


def judged(figures: dict, reasons: list[str]) -> dict:
    """``pass`` when ``reasons`` (missed thresholds, in words) is empty, else ``fail`` naming them."""
    return {"status": "fail", **figures, "reasons": reasons} if reasons else {"status": "pass", **figures}
