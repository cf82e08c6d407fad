"""Length distributions of the synthetic groups the ``train`` bench scope packs and trains.

Spec strings (``--prompt-len`` / ``--response-len``):

- ``fixed:N``: every length is N;
- ``uniform:A,B``: integers uniform in [A, B];
- ``heavy:MEDIAN[,SIGMA]``: lognormal with median MEDIAN and log-space spread SIGMA (default
  1.0): most lengths short, a long tail (the straggler shape of reasoning responses).

Every draw is clipped to [1, cap] (cap: ``data.max_prompt_tokens`` for prompts,
``rollout.sampling.max_new_tokens`` for responses), as an engine's output would be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

LengthKind = Literal["fixed", "uniform", "heavy"]


@dataclass(frozen=True, kw_only=True)
class LengthDist:
    """A length distribution; ``a`` / ``b`` mean (N, -), (A, B) or (MEDIAN, SIGMA) by ``kind``."""

    kind: LengthKind
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str, *, flag: str = "--response-len") -> LengthDist:
        """``fixed:64`` | ``uniform:32,128`` | ``heavy:64[,1.0]``; ``ValueError`` naming ``flag`` otherwise."""
        kind, _, args = spec.partition(":")
        try:
            values = [float(x) for x in args.split(",")] if args else []
        except ValueError:
            values = []
        ok = (
            (kind == "fixed" and len(values) == 1 and values[0] >= 1)
            or (kind == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1])
            or (kind == "heavy" and len(values) in (1, 2) and values[0] >= 1 and (len(values) == 1 or values[1] > 0))
        )
        if not ok:
            raise ValueError(f"{flag} {spec!r}: expected fixed:N, uniform:A,B (1 <= A <= B) or heavy:MEDIAN[,SIGMA]")
        if kind == "heavy" and len(values) == 1:
            values.append(1.0)
        return cls(kind=kind, a=values[0], b=values[1] if len(values) > 1 else 0.0)

    def sample(self, rng: np.random.Generator, n: int, *, cap: int) -> list[int]:
        """``n`` lengths drawn from the distribution, clipped to [1, cap]."""
        if self.kind == "fixed":
            raw = np.full(n, self.a)
        elif self.kind == "uniform":
            raw = rng.integers(int(self.a), int(self.b) + 1, size=n)
        else:  # lognormal: median = exp(mu)
            raw = rng.lognormal(mean=math.log(self.a), sigma=self.b, size=n)
        return [int(x) for x in np.clip(np.rint(raw), 1, cap)]

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        return f"uniform:{int(self.a)},{int(self.b)}" if self.kind == "uniform" else f"heavy:{self.a:g},{self.b:g}"
