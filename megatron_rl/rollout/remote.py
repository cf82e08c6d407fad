"""Engines on other nodes: rank 0's ``EngineHub`` and the ``RemoteProcess`` that stands in for
a local worker process, so ``supervision`` supervises remote workers with the same code.

Transport: ``multiprocessing.connection`` over TCP (the standard library's authenticated
message connections, the same ``Connection`` class the local workers' pipes are), chosen
because the worker protocol (``rollout.worker``: pickled commands and answers, one connection
per worker) then crosses the network unchanged: deaths, hangs (``rollout.request_timeout_s``),
restarts and re-issued requests are ``Supervisor`` / ``dispatch`` code, not a second copy.

Connections, all opened *to* the hub (``rollout.sync_address``:``rollout.engine_port``), so
rank 0 needs no address of any other node:

- control, one per remote engine, from the engine host of its node (``rollout.engine_host``),
  opened once with ``HostHello``: the hub sends ``Spawn`` / ``Kill``; the host answers
  ``Exited`` when the engine's process ends. It is the worker's *sentinel*: readable when the
  process ended, or when the host (the node) is gone.
- data, one per worker process, from the worker itself (``WorkerHello``): the pipe of a local
  worker, unchanged protocol.

Every connection is authenticated with ``engine_key`` (HMAC challenge of
``multiprocessing.connection``) before anything is unpickled. The key is the secret
``MEGATRON_RL_ENGINE_KEY``, the same on every node; it is required whenever the hub's address is
not loopback: a key derived from the address would be known to whoever can reach the hub, who
could then send rank 0 a pickle to load. On loopback (one machine) a derived key is allowed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge, wait
from typing import Any

from megatron_rl.rollout.worker import WorkerSpec

HANDSHAKE_S = 10.0  # a connection that has not said who it is by then is dropped


@dataclass(frozen=True)
class HostHello:
    engine: int  # the engine index this control connection serves
    node: int


@dataclass(frozen=True)
class WorkerHello:
    engine: int
    nonce: int  # the Spawn it answers
    pid: int


@dataclass(frozen=True)
class Spawn:
    nonce: int
    spec: WorkerSpec
    start_load: Any  # weight_sync.WorkerLoad or None
    version: int


@dataclass(frozen=True)
class Kill:
    nonce: int


@dataclass(frozen=True)
class Exited:
    nonce: int
    exitcode: int | None


KEY_VAR = "MEGATRON_RL_ENGINE_KEY"
KEY_HOWTO = (
    f"export {KEY_VAR}=$(python -c 'import secrets;print(secrets.token_hex(32))') once, and give "
    "every node (rank 0 and each engine host) that same value"
)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: ``localhost``, 127.0.0.0/8 or ``::1``."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def engine_key(host: str, port: int) -> bytes:
    """The connections' authentication key: ``MEGATRON_RL_ENGINE_KEY``; without it, on a loopback
    hub only, one derived from the address (it keeps stray local clients out, it is no secret).
    ``ValueError`` for a hub on any other address without the key (module doc)."""
    secret = os.environ.get(KEY_VAR, "").strip()
    if not secret and not is_loopback(host):
        raise ValueError(
            f"remote engines: the engine hub at {host}:{port} (rollout.sync_address / rollout.engine_port, or "
            f"serve --connect) is not a loopback address, and {KEY_VAR} is not set, so anyone who can reach it "
            f"could make rank 0 load their data. Set a secret key: {KEY_HOWTO}"
        )
    text = secret or f"megatron_rl-engines:{host}:{port}"
    return hashlib.sha256(text.encode()).digest()


class EngineHub:
    """Rank 0's listener: control connections of the engine hosts, data connections of workers."""

    def __init__(self, host: str, port: int):
        self.address = (host, port)
        self._key = engine_key(host, port)
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as err:
            self._sock.close()
            raise OSError(
                f"rollout.engine_port: cannot listen on {host}:{port} for remote engines ({err}); "
                "choose a free port (the launchers use MASTER_PORT + 1)"
            ) from err
        self._sock.listen(64)
        self._cond = threading.Condition()
        self._control: dict[int, Connection] = {}
        self._data: dict[tuple[int, int], tuple[Connection, int]] = {}
        self._nonces = itertools.count(1)
        self._closed = False
        threading.Thread(target=self._accept_loop, name="engine-hub", daemon=True).start()

    def spawn(self, spec: WorkerSpec, start_load, version: int, timeout_s: float) -> tuple[RemoteProcess, Connection]:
        """Start engine ``spec.index`` on its node's host; (its process stand-in, its data connection)."""
        control = self._wait(
            lambda: self._control.get(spec.index),
            timeout_s,
            f"no engine host of node {spec.node} connected for engine {spec.index} "
            f"(start `python -m megatron_rl serve CONFIG --node-rank {spec.node}` there)",
        )
        nonce = next(self._nonces)
        process = RemoteProcess(spec, control, nonce)
        try:
            control.send(Spawn(nonce, spec, start_load, version))
        except OSError:
            process.lost()
        conn, pid = self._wait(
            lambda: self._data.pop((spec.index, nonce), None) or ((None, None) if not process.is_alive() else None),
            timeout_s,
            f"engine {spec.index} on node {spec.node} did not connect (rollout.start_timeout_s)",
        )
        if conn is None:  # ended before connecting: Supervisor reports its exit code
            conn = _closed_connection()
        process.pid = pid
        return process, conn

    def close(self) -> None:
        """Stop listening; the control connections close (the hosts then stop their engines)."""
        with self._cond:
            self._closed = True
            conns = list(self._control.values()) + [c for c, _ in self._data.values()]
            self._control.clear()
            self._data.clear()
        self._sock.close()
        for c in conns:
            c.close()

    def _wait(self, get, timeout_s: float, message: str):
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while (found := get()) is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    from megatron_rl.rollout.supervision import RolloutWorkerError

                    raise RolloutWorkerError(message)
                self._cond.wait(min(left, 0.5))  # also polls the process state (no notify on exit)
            return found

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._greet, args=(sock,), daemon=True).start()

    def _greet(self, sock: socket.socket) -> None:
        conn = Connection(sock.detach())  # blocking fd (a socket timeout would make it non-blocking)
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            hello = conn.recv() if conn.poll(HANDSHAKE_S) else None
        except (OSError, EOFError, AuthenticationError) as err:  # a stray or dead client: dropped
            hello = err
        with self._cond:
            if isinstance(hello, HostHello) and not self._closed:
                old = self._control.pop(hello.engine, None)
                self._control[hello.engine] = conn
                if old is not None:
                    old.close()
            elif isinstance(hello, WorkerHello) and not self._closed:
                self._data[(hello.engine, hello.nonce)] = (conn, hello.pid)
            else:
                conn.close()
            self._cond.notify_all()


def _closed_connection() -> Connection:
    """A connection whose far end is closed: a worker that never connected reads as EOF."""
    a, b = socket.socketpair()
    b.close()
    return Connection(a.detach())


class RemoteProcess:
    """The ``multiprocessing.Process`` interface ``Supervisor`` uses, for a worker on another node."""

    def __init__(self, spec: WorkerSpec, control: Connection, nonce: int):
        self.name = f"rollout-worker-{spec.index}@node{spec.node}"
        self.pid: int | None = None
        self.exitcode: int | None = None
        self.sentinel = control  # readable when the host reports the exit, or is gone
        self._control, self._nonce, self._ended = control, nonce, False

    def is_alive(self) -> bool:
        while not self._ended:
            try:
                if not self._control.poll():
                    return True
                message = self._control.recv()
            except (EOFError, OSError):
                self.lost()
                return False
            if isinstance(message, Exited) and message.nonce == self._nonce:
                self._ended, self.exitcode = True, message.exitcode
        return False

    def lost(self) -> None:
        """The engine host (its node) is unreachable: the worker counts as dead."""
        self._ended, self.exitcode = True, -1

    def kill(self) -> None:
        if not self._ended:
            try:
                self._control.send(Kill(self._nonce))
            except OSError:
                self.lost()

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            wait([self._control], timeout=left)
