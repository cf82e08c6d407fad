"""The body of one engine worker process, and the messages it exchanges with its pool.

Each worker owns one duplex pipe to the parent and has at most one command outstanding:

    parent -> worker: Generate(requests) | Score(requests) | Receive(load, version) | Stop()
                      Abort(request_ids)                 not a command: no answer of its own
    worker -> parent: Ready(version, streaming)          once, after start-up
                      Result(result)* then Done(ids)     for Generate / Score (one Result per request;
                                                         ids: the command's request ids)
                      Loaded(version)                    for Receive
                      Failed(request_ids, error)         instead of Done / Loaded / Ready

``Abort(ids)`` ends those of ``ids`` still queued or running: each is answered by a ``Result``
whose ``finish_reason`` is ``"abort"`` (the tokens it had so far, when the engine keeps them),
in place of its normal one; an id already answered (or unknown) is ignored, so every request is
still answered exactly once and its command's ``Done`` follows as usual. A chunked worker reads
Aborts between its backend's decode steps when the backend offers ``between_steps`` (hf), else
between commands; a streaming worker between engine steps (``abort(ids)`` of the backend).

A chunked backend (``WorkerBackend``) answers one command at a time, in order. A backend that
also implements ``rollout.stream_worker.StreamingBackend`` (``streaming`` in its ``Ready``) runs
its engine step by step instead (``stream_worker.serve_stream``): Generate commands that arrive
meanwhile join the running batch, each Result leaves as soon as its request finishes, and a
command's Done as soon as its last request did, so Dones may come out of order.

With in-flight updates (``WorkerSpec.in_flight_staleness``, ``rollout.in_flight``) a ``Receive`` that
arrives while requests run is loaded between two decode steps (hf: ``HFBackend.between_steps``;
streaming: ``stream_worker``), answered by ``Loaded`` at once, and the requests carry on at the new
version.

``Receive`` carries a ``weight_sync.WorkerLoad``; the worker hands it to the receiver of its
transport (``weight_sync.build_receiver``, one per transport, kept for the worker's life),
which feeds HF-named tensors to the backend's ``load_tensors``. A worker started after a sync
loads the current update's ``at_start`` load before it reports ``Ready``.

A pipe per worker (not a shared queue) means a worker killed mid-write can corrupt nothing
but its own pipe, which the pool throws away. The worker strips torchrun's environment
(vLLM hangs inside a torchrun rank otherwise), pins itself to its device set, then imports
its backend: heavy imports happen only in the child.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from megatron_rl.rollout.scoring import ScoreRequest, ScoreResult
from megatron_rl.rollout.settings import DeviceAssignment
from megatron_rl.rollout.types import GenerationRequest, GenerationResult

# Variables torchrun / torch elastic set for a training rank; a worker is never such a rank.
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
VISIBLE_DEVICES_VAR = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}
BACKEND_CLASSES = {
    "hf": "megatron_rl.rollout.backends.hf:HFBackend",
    "vllm": "megatron_rl.rollout.backends.vllm:VLLMBackend",
}


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """What a worker process needs to build its backend (pickled into the child)."""

    index: int
    backend: str  # a key of BACKEND_CLASSES, or "package.module:Class"
    model_path: str
    device: DeviceAssignment
    node: int = 0  # the node it runs on (rollout.engine_nodes): > 0 means its node's engine host starts it
    dtype: str = "float32"
    tensor_parallel_size: int = 1
    max_batch_size: int = 16
    seed: int = 0
    env: Mapping[str, str] = field(default_factory=dict)
    backend_kwargs: Mapping[str, Any] = field(default_factory=dict)
    return_routed_experts: bool = False  # MoE: return each forwarded token's experts (routing replay)
    # rollout.in_flight_updates: updates are loaded between decode steps, requests started more than
    # this many versions back restart (rollout.in_flight); None: updates only while idle
    in_flight_staleness: int | None = None


class WorkerBackend(Protocol):
    """A generation engine living inside one worker process (built as ``Class(spec)``)."""

    def generate(self, requests: Sequence[GenerationRequest], weight_version: int) -> Iterator[GenerationResult]:
        """Yield exactly one result per request, each stamped with ``weight_version``."""
        ...

    def score(self, requests: Sequence[ScoreRequest], weight_version: int) -> Iterator[ScoreResult]:
        """Yield one teacher-forced ``ScoreResult`` per request (prefill only), stamped with ``weight_version``."""
        ...

    def load_tensors(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the weights in place with HF-named tensors (every parameter exactly once).
        A backend whose class sets ``streams_weights = True`` copies each tensor before taking
        the next (its receive buffers are then reused)."""
        ...

    @property
    def device(self) -> Any:
        """The torch device the model's weights live on (receive buffers are allocated there)."""
        ...


@dataclass(frozen=True)
class Generate:
    requests: tuple[GenerationRequest, ...]


@dataclass(frozen=True)
class Score:
    requests: tuple[ScoreRequest, ...]


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Receive:
    load: Any  # weight_sync.WorkerLoad
    version: int  # the version the worker runs once ``load`` is loaded (if it loads)


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]  # requests to end now (module doc); not a command: no answer of its own


@dataclass(frozen=True)
class Ready:
    version: int
    streaming: bool = False  # Generate commands join a running batch; Dones may come out of order


@dataclass(frozen=True)
class Result:
    result: GenerationResult | ScoreResult


@dataclass(frozen=True)
class Done:
    request_ids: tuple[str, ...] = ()  # the answered command's requests


@dataclass(frozen=True)
class Loaded:
    version: int
    stale_restarts: int = 0  # in-flight update: requests restarted by the bounded-staleness rule


@dataclass(frozen=True)
class Failed:
    request_ids: tuple[str, ...]
    error: str  # formatted traceback from the worker


def prepare_process(device: DeviceAssignment, env: Mapping[str, str]) -> None:
    """Strip torchrun's variables, apply ``env``, and restrict this process to ``device``."""
    for name in list(os.environ):
        if name in TORCHRUN_VARS or name.startswith("TORCHELASTIC_"):
            del os.environ[name]
    os.environ.update(env)
    if device.kind in VISIBLE_DEVICES_VAR:
        os.environ[VISIBLE_DEVICES_VAR[device.kind]] = ",".join(map(str, device.ids))
    elif device.ids:
        os.sched_setaffinity(0, device.ids)
        os.environ["OMP_NUM_THREADS"] = str(len(device.ids))


def build_backend(spec: WorkerSpec) -> WorkerBackend:
    """Import and construct the backend class that ``spec.backend`` names."""
    module_name, _, class_name = BACKEND_CLASSES.get(spec.backend, spec.backend).partition(":")
    return getattr(importlib.import_module(module_name), class_name)(spec)


def worker_main(spec: WorkerSpec, conn, start_load, version: int) -> None:
    """Process entry point: build the backend (loading ``start_load`` if given), then serve."""
    prepare_process(spec.device, spec.env)
    receivers: dict = {}
    try:
        backend = build_backend(spec)
        if start_load is not None:
            receive_load(backend, start_load, receivers)
    except Exception:  # reported to the parent, which raises it there
        conn.send(Failed((), traceback.format_exc()))
        return
    if getattr(backend, "streams_requests", False):
        from megatron_rl.rollout.stream_worker import serve_stream

        conn.send(Ready(version, streaming=True))
        serve_stream(backend, conn, version, receivers)
        return
    conn.send(Ready(version))
    _serve(backend, conn, version, receivers)


def receive_load(backend: WorkerBackend, load, receivers: dict) -> None:
    """Hand ``load`` to the receiver of its transport (built on first use, then kept)."""
    from megatron_rl.weight_sync import build_receiver
    from megatron_rl.weight_sync.buckets import one_copy_thread

    receiver = receivers.get(load.transport)
    if receiver is None:
        receiver = receivers[load.transport] = build_receiver(load.transport)
    with one_copy_thread():
        receiver.receive(load, backend)


def _serve(backend: WorkerBackend, conn, version: int, receivers: dict) -> None:
    inbox = AbortInbox(conn)
    if hasattr(backend, "between_steps"):  # hf: Aborts are read between decode steps
        backend.between_steps = inbox.poll
    loads = _InFlightPoll(backend, inbox, conn, receivers, version) if _in_flight(backend) else None
    while True:
        try:
            command = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if isinstance(command, Stop):
            return
        if isinstance(command, Generate) and inbox.aborted:
            _generate_unaborted(backend, conn, command, version, inbox.aborted)
        else:
            version = handle_command(backend, conn, command, version, receivers)
        inbox.done(command)
        version = loads.sync(version) if loads is not None else version


def _in_flight(backend: WorkerBackend) -> bool:
    """Whether ``backend`` takes weight updates between decode steps (``rollout.in_flight``)."""
    return getattr(backend, "in_flight_staleness", None) is not None and hasattr(backend, "between_steps")


class _InFlightPoll:
    """A chunked worker's in-flight updates (``rollout.in_flight``): between two decode steps the
    Receives waiting on the pipe are loaded at once (Aborts are read as before); ``version`` is
    the version the worker runs."""

    def __init__(self, backend, inbox: AbortInbox, conn, receivers: dict, version: int) -> None:
        self._backend, self._inbox, self._conn, self._receivers = backend, inbox, conn, receivers
        self.version = version
        backend.between_steps = self.poll

    def poll(self) -> set[str]:
        """``AbortInbox.poll``, loading the Receives read meanwhile."""
        from megatron_rl.rollout.in_flight import load_between_steps

        aborted = self._inbox.poll()
        for command in [c for c in self._inbox._waiting if isinstance(c, Receive)]:
            self._inbox._waiting.remove(command)
            self.version = load_between_steps(
                self._backend, self._conn, command, self.version, lambda b, load: receive_load(b, load, self._receivers)
            )
        return aborted

    def sync(self, version: int) -> int:
        """After a command: the newer of ``version`` and what was loaded during it."""
        self.version = max(self.version, version)
        return self.version


def aborted_result(request: GenerationRequest, version: int) -> GenerationResult:
    """The answer to a request aborted before it produced a token."""
    return GenerationResult(
        request_id=request.request_id,
        prompt_ids=request.prompt_ids,
        response_ids=(),
        logprobs=(),
        finish_reason="abort",
        weight_version=version,
    )


class AbortInbox:
    """A chunked worker's view of its pipe: commands in order, ``Abort``s taken out as they come."""

    def __init__(self, conn) -> None:
        self._conn, self._waiting = conn, deque()
        self._live: set[str] = set()  # ids of the Generates read and not finished (waiting or running)
        self.aborted: set[str] = set()  # of those, the ids an Abort named

    def recv(self) -> object:
        """The next command that is not an Abort (blocking)."""
        while not self._waiting:
            self._take(self._conn.recv())
        return self._waiting.popleft()

    def poll(self) -> set[str]:
        """Read what waits on the pipe without blocking; every id aborted so far."""
        while self._conn.poll():
            self._take(self._conn.recv())
        return self.aborted

    def done(self, command: object) -> None:
        """``command`` was answered: its ids are forgotten (a later call may reuse them)."""
        if isinstance(command, Generate):
            ids = {r.request_id for r in command.requests}
            self._live -= ids
            self.aborted -= ids

    def _take(self, message: object) -> None:
        # An Abort follows the Generate of its ids on the pipe: an id not live was answered already.
        if isinstance(message, Abort):
            self.aborted.update(rid for rid in message.request_ids if rid in self._live)
            return
        if isinstance(message, Generate):
            self._live.update(r.request_id for r in message.requests)
        self._waiting.append(message)


def _generate_unaborted(backend: WorkerBackend, conn, command: Generate, version: int, aborted: set[str]) -> None:
    """``handle_command`` of a Generate some of whose requests were aborted while it was queued:
    those are answered at once (no token), the rest generated; the Done names every request."""
    ids = tuple(r.request_id for r in command.requests)
    for r in command.requests:
        if r.request_id in aborted:
            conn.send(Result(aborted_result(r, version)))
    todo = tuple(r for r in command.requests if r.request_id not in aborted)
    try:
        for result in backend.generate(todo, version) if todo else ():
            conn.send(Result(result))
    except Exception:
        conn.send(Failed(ids, traceback.format_exc()))
        return
    conn.send(Done(ids))


def handle_command(backend: WorkerBackend, conn, command: object, version: int, receivers: dict) -> int:
    """Run one Receive / Generate / Score command to its end, answering on ``conn``; returns the
    version the worker runs afterwards."""
    if isinstance(command, Receive):
        try:
            receive_load(backend, command.load, receivers)
        except Exception:
            conn.send(Failed((), traceback.format_exc()))
            return version
        version = command.version if command.load.loads else version
        conn.send(Loaded(version))
    elif isinstance(command, (Generate, Score)):
        run = backend.generate if isinstance(command, Generate) else backend.score
        ids = tuple(r.request_id for r in command.requests)
        try:
            for result in run(command.requests, version):
                conn.send(Result(result))
        except Exception:
            conn.send(Failed(ids, traceback.format_exc()))
            return version
        conn.send(Done(ids))
    return version
