"""The engine host of one node (``python -m megatron_rl serve CONFIG --node-rank N``: ``cli.serve``).

Runs the engines that ``rollout.engine_nodes`` places on node N, for the dispatcher on global
rank 0 (``rollout.remote.EngineHub`` at ``rollout.sync_address``:``rollout.engine_port``, or
``--connect HOST:PORT``). The launchers start it on every node with engines (node 0's
engines are rank 0's own workers); started by hand on other machines it makes a
disaggregated rollout pool for a run whose ``engine_nodes`` names those node ranks.

Per engine, one ``EngineKeeper`` thread holds the control connection to the hub: it starts
the worker process when told (``Spawn``: the process connects its data connection to the
hub itself and serves the ordinary worker protocol), kills it when told (``Kill``), and
reports its end (``Exited``). The host exits once the hub closes every control connection
(the run is over); a hub that never answers within ``rollout.start_timeout_s`` is an error.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection

from megatron_rl.rollout.remote import Exited, HostHello, Kill, Spawn, WorkerHello, engine_key
from megatron_rl.rollout.worker import WorkerSpec, worker_main

NODE_ADDR_VAR = "MEGATRON_RL_NODE_ADDR"  # this node's address: sync groups bind their sockets to it


def remote_worker_main(spec: WorkerSpec, hub: tuple[str, int], nonce: int, start_load, version: int) -> None:
    """Worker process entry point: connect to the hub, then serve like a local worker."""
    conn = Client(hub, authkey=engine_key(*hub))
    conn.send(WorkerHello(spec.index, nonce, os.getpid()))
    worker_main(spec, conn, start_load, version)


def connect(hub: tuple[str, int], hello: HostHello, timeout_s: float) -> Connection:
    """A control connection to the hub, retried until it listens (rank 0 may start later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(hub, authkey=engine_key(*hub))
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"engine host: no dispatcher listening at {hub[0]}:{hub[1]} after {timeout_s} s "
                    "(rollout.sync_address / rollout.engine_port; rollout.start_timeout_s)"
                ) from None
            time.sleep(0.5)
            continue
        conn.send(hello)
        return conn


class EngineKeeper:
    """One engine of this node: its control connection and its current worker process."""

    def __init__(self, spec: WorkerSpec, hub: tuple[str, int], timeout_s: float, wrap=None):
        self.spec, self.hub, self.timeout_s = spec, hub, timeout_s
        self._wrap = wrap  # WorkerSpec -> WorkerSpec (chaos runs: rollout.faults) or None
        self._ctx = mp.get_context("spawn")
        self._process: mp.process.BaseProcess | None = None
        self._nonce = 0
        self._send_lock = threading.Lock()

    def run(self) -> None:
        """Serve the hub's commands until it closes the connection; the worker dies with it."""
        conn = connect(self.hub, HostHello(self.spec.index, self.spec.node), self.timeout_s)
        try:
            while True:
                try:
                    command = conn.recv()
                except (EOFError, OSError):
                    return
                if isinstance(command, Spawn):
                    self._start(conn, command)
                elif isinstance(command, Kill) and command.nonce == self._nonce and self._process is not None:
                    self._process.kill()
        finally:
            self._stop()
            conn.close()

    def _start(self, conn: Connection, command: Spawn) -> None:
        self._stop()
        spec = self._wrap(command.spec) if self._wrap is not None else command.spec
        self._nonce = command.nonce
        self._process = self._ctx.Process(
            target=remote_worker_main,
            args=(spec, self.hub, command.nonce, command.start_load, command.version),
            name=f"rollout-worker-{spec.index}",
            daemon=False,
        )
        self._process.start()
        threading.Thread(target=self._report_exit, args=(conn, self._process, command.nonce), daemon=True).start()

    def _report_exit(self, conn: Connection, process, nonce: int) -> None:
        process.join()
        with self._send_lock:
            try:
                conn.send(Exited(nonce, process.exitcode))
            except OSError:  # the hub is gone
                pass

    def _stop(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._process.kill()
            self._process.join()


def serve(specs: list[WorkerSpec], hub: tuple[str, int], *, timeout_s: float, wrap=None) -> int:
    """Run ``specs`` (this node's engines) for the hub until it lets go; returns an exit status.
    ``wrap``: applied to each spec the hub sends before its process starts (fault injection)."""
    if not specs:
        print("engine host: no engine of rollout.engine_nodes is on this node; nothing to serve", file=sys.stderr)
        return 0
    engine_key(*hub)  # ValueError here, not in each keeper's thread, when a non-loopback hub has no key
    errors: list[BaseException] = []

    def keep(spec: WorkerSpec) -> None:
        try:
            EngineKeeper(spec, hub, timeout_s, wrap).run()
        except (TimeoutError, AuthenticationError, OSError) as err:
            errors.append(err)

    threads = [threading.Thread(target=keep, args=(s,), name=f"engine-{s.index}") for s in specs]
    for t in threads:
        t.start()
    print(
        f"engine host: engines {[s.index for s in specs]} of node {specs[0].node} serving {hub[0]}:{hub[1]}",
        file=sys.stderr,
    )
    for t in threads:
        t.join()
    for err in errors:
        print(f"engine host: {err}", file=sys.stderr)
    return 1 if errors else 0
