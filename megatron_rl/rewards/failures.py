"""Failure bookkeeping shared by guarded user code (reward functions, environments): counts by
kind, the first error's text, and one warning per kind with its traceback (the rest only
counted, so a broken function does not flood the log). Thread-safe."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable


class FailureLog:
    """Counts of failed calls by kind; ``record`` warns on the first of each kind."""

    def __init__(self, kinds: Iterable[str], *, logger: logging.Logger, subject: str, consequence: str) -> None:
        """``subject`` names what failed in the warning ("reward my_fn"); ``consequence`` says
        what a failure does ("scored 0")."""
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(kinds, 0)
        self._first: str | None = None
        self._logger, self._subject, self._consequence = logger, subject, consequence

    def record(self, kind: str, text: str, trace: str = "") -> None:
        """Count one failure of ``kind`` described by ``text``."""
        with self._lock:
            first_of_kind = self._counts[kind] == 0
            self._counts[kind] += 1
            self._first = self._first or text
        if first_of_kind:
            self._logger.warning(
                "%s: %s; %s (further %s failures are only counted)%s",
                self._subject,
                text,
                self._consequence,
                kind,
                f"\n{trace}" if trace else "",
            )

    def counts(self) -> dict[str, int]:
        """A copy of the counts by kind."""
        with self._lock:
            return dict(self._counts)

    @property
    def first_error(self) -> str | None:
        """The first failure's text (None before any)."""
        with self._lock:
            return self._first
