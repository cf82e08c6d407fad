"""One reward worker process and its pipe: what ``pool.RewardPool`` (a reward function per call)
and ``model_reward.RewardModelReward`` (a reward model per batch) both run on.

Contract: ``ProcessWorker(setup)`` starts ``setup.target(setup.arg, conn)`` in a process of the
``setup.context`` start method (``forkserver`` with ``setup.preload`` imported once, or
``spawn``; never ``fork``: the trainer holds threads) on first use, and again after a kill. The
target builds what it scores and calls ``serve(conn, build)``: it answers ``("ready", None, "")``
once built, or ``("failed", message, traceback)``, then one ``Answer`` per message until None /
EOF. ``start()`` waits ``start_timeout_s`` for that handshake; a worker that fails, dies or stays
silent while loading raises ``RuntimeError`` starting with ``setup.what`` (the run stops with it).
``call(message, timeout_s)`` is one message's ``Answer``: the worker's own, ``("timeout", ...)``
past ``timeout_s`` (reward.timeout_s; the process is killed, the next call starts a fresh one), or
``("crashed", ...)`` when it died before answering (replaced the same way). ``close()`` ends it.
"""

from __future__ import annotations

import multiprocessing as mp
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Answer = tuple[str, Any, str]  # (kind, value or message, traceback)
_GONE = (EOFError, BrokenPipeError, ConnectionResetError)


@dataclass(frozen=True, kw_only=True)
class WorkerSetup:
    """What a ``ProcessWorker`` starts and how its start failures read."""

    target: Callable[[Any, Any], None]  # module-level (picklable): target(arg, conn) calls serve
    arg: Any
    context: str  # multiprocessing start method: "forkserver" or "spawn"
    name: str  # the process name
    what: str  # start errors begin with it, e.g. "reward worker for 'pkg.mod:fn'"
    hint: str = ""  # appended to a load failure's error (what the user should check)
    preload: tuple[str, ...] = ()  # forkserver only: modules the server imports once
    start_timeout_s: float = 300.0


def serve(conn: Any, build: Callable[[], Callable[[Any], Answer]]) -> None:
    """The worker's side: ``build()`` the handler, answer the handshake, then each message until None / EOF.
    A handler that raises answers ``("raised", ...)``: the parent counts it for the message's calls."""
    try:
        handle = build()
    except Exception as err:  # reported to the parent, which stops the run with it
        conn.send(("failed", f"{type(err).__name__}: {err}", traceback.format_exc()))
        return
    conn.send(("ready", None, ""))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        try:
            answer = handle(message)
        except Exception as err:
            answer = ("raised", f"{type(err).__name__}: {err}", traceback.format_exc())
        conn.send(answer)


class ProcessWorker:
    """One worker process and its pipe (see the module doc)."""

    def __init__(self, setup: WorkerSetup) -> None:
        self.setup = setup
        self.proc: Any = None
        self.conn: Any = None
        self.starts = 0

    def call(self, message: Any, timeout_s: float | None) -> Answer:
        """One message's answer: the worker's, or ``("timeout", ...)`` / ``("crashed", ...)``."""
        self.start()
        try:
            self.conn.send(message)
            if not self.conn.poll(timeout_s):
                self.kill()
                return ("timeout", f"no answer after {timeout_s} s (reward.timeout_s); worker process killed", "")
            return self.conn.recv()
        except _GONE:  # died before or while answering (killed from outside, a segfault, the OOM killer)
            self.proc.join(5.0)
            code = self.proc.exitcode
            self.kill()
            return ("crashed", f"the reward worker process died (exit code {code}); replaced", "")

    def start(self) -> None:
        """Start the process and wait for its handshake (no-op while it runs)."""
        if self.proc is not None:
            return
        s = self.setup
        ctx = mp.get_context(s.context)
        if s.preload:
            ctx.set_forkserver_preload(list(s.preload))
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=s.target, args=(s.arg, child), name=s.name, daemon=True)
        self.proc.start()
        child.close()
        self.starts += 1
        problem = self._handshake()
        if problem:
            self.kill()
            raise RuntimeError(f"{s.what} {problem}{'; ' + s.hint if s.hint else ''}")

    def _handshake(self) -> str:
        """'' once the worker is ready, else why not."""
        if not self.conn.poll(self.setup.start_timeout_s):
            return f"not ready after {self.setup.start_timeout_s} s"
        try:
            kind, message, trace = self.conn.recv()
        except EOFError:
            self.proc.join(5.0)
            return f"died while loading (exit code {self.proc.exitcode})"
        return "" if kind == "ready" else f"could not load ({message})\n{trace}"

    def kill(self) -> None:
        """End the process now (SIGKILL); the next call starts a fresh one."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.join()
            self.conn.close()
        self.proc = self.conn = None

    def close(self) -> None:
        """Ask the process to stop, then end it."""
        if self.proc is not None:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5.0)
        self.kill()
