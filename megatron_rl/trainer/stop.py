"""Graceful stop on SIGTERM / SIGINT: finish the current step, checkpoint, exit together.

A scheduler preempting a job (SIGTERM, sent by torchrun / msrun to every rank) or a user
pressing Ctrl-C (SIGINT) sets a flag instead of killing the process mid-step. After each step
the replica polls the flags of all its ranks (``Replica.poll_stop``: one all-reduce), so every
rank takes the same decision even when only one of them was signalled; the leader then writes
a complete checkpoint (staged and renamed, never a partial one) and all ranks leave the loop.
A second SIGINT restores the default handler, so Ctrl-C twice still interrupts at once.

``NonFiniteGuard`` ends a run whose optimizer steps keep being skipped for NaN / inf losses or
gradients (``trainer.max_nonfinite_steps`` in a row); the last complete checkpoint stays as it was.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The stop flag of this process, set by SIGTERM / SIGINT while ``installed``."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> StopRequest:
        """Handle SIGTERM / SIGINT (main thread only; elsewhere the defaults stay)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"megatron_rl: {signal.Signals(signum).name} received; stopping after the current step "
            "(with a checkpoint if trainer.save_dir is set)",
            flush=True,
        )


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row were skipped for non-finite losses or gradients."""


class NonFiniteGuard:
    """Counts steps whose optimizer steps were skipped as non-finite; raises after ``limit`` in a row."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row = limit, 0

    def check(self, step: int, nonfinite_steps: float) -> None:
        self.in_a_row = self.in_a_row + 1 if nonfinite_steps > 0 else 0
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: the loss or gradients were NaN / inf in {self.in_a_row} steps in a row "
                f"(trainer.max_nonfinite_steps={self.limit}); the optimizer skipped them on every rank. Likely "
                "causes: a learning rate too high, bf16 overflow, a broken kernel, NaN in the weights. The last "
                "complete checkpoint is unchanged."
            )
