"""The gateway's HTTP server (FastAPI on uvicorn, in a thread of its own) and its link to the
engine pool's stream.

- ``Gateway(settings, codec=, sampling=)``: ``start()`` listens on ``settings.host`` /
  ``settings.port`` (0: a free port); loopback unless a key is set (``ValueError`` naming
  ``agent.key`` otherwise), and with a key every request must carry ``Authorization: Bearer
  <key>``. ``open_session(...)`` registers a ``Session`` under an unguessable id: its base URL
  is ``http://<host>:<port>/sessions/<id>/v1`` (``/chat/completions``, ``/models``).
- ``EngineLink(engine)``: one ``generate_stream`` over a ``RequestFeed`` for the requests of
  every open session (``Gateway.attach``); ``results()`` hands each answered turn's
  (request id, weight version) to the caller's thread (the producer's staleness check).
- A turn's stop ids are the sampling section's, the template's end-of-turn token and each
  one-token ``stop`` string; a ``stop`` string of any length is then looked for in the turn's
  text and the turn cut before it (``detok.stop_cut``: ids, log-probs and text alike,
  finish_reason "stop"), so the session trains exactly the tokens whose text the client got.
- Every refused request gets OpenAI's error JSON (400 malformed, 401 key, 404 no such session,
  409 session closed, 500 anything else) and is counted on the session; the server never stops
  for one.
"""

from __future__ import annotations

import asyncio
import queue
import secrets
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from megatron_rl.gateway.detok import pieces, stop_cut
from megatron_rl.gateway.openai_format import (
    ChatRequest,
    RequestError,
    Turn,
    assistant_turn,
    completion,
    recorded_message,
    sse_chunks,
    stop_ids,
)
from megatron_rl.gateway.session import Session, TemplateCodec
from megatron_rl.rollout.feed import RequestFeed, StreamingEngine
from megatron_rl.rollout.types import GenerationRequest, GenerationResult, SamplingSettings

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True, kw_only=True)
class GatewaySettings:
    """Where the gateway listens (the ``agent`` section)."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    key: str | None = None  # required for a non-loopback host
    model_name: str = "policy"  # what /v1/models lists (any model name is accepted)

    def __post_init__(self) -> None:
        if self.host not in LOOPBACK and not self.key:
            raise ValueError(f"agent.host={self.host!r} is not loopback: set agent.key (requests must carry it)")


class EngineLink:
    """The sessions' turns on one engine stream (module doc)."""

    def __init__(self, engine: StreamingEngine) -> None:
        if not isinstance(engine, StreamingEngine):
            raise TypeError(f"agent rollouts need an engine with generate_stream; got {type(engine).__name__}")
        self.feed, self._futures, self._lock = RequestFeed(), {}, threading.Lock()
        self._answered: queue.Queue[tuple[str, int]] = queue.Queue()
        self.error: BaseException | None = None  # what the stream raised
        self.ended = False
        self._thread = threading.Thread(target=self._pump, args=(engine,), name="megatron_rl-gateway", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future:
        """Put one turn on the stream; its future holds the ``GenerationResult``."""
        future: Future = Future()
        with self._lock:
            if self.ended:
                raise RuntimeError(f"the engine stream ended: {self.error}")
            self._futures[request.request_id] = future
        self.feed.put(request)
        return future

    def results(self) -> list[tuple[str, int]]:
        """(request id, weight version) of each turn answered since the last call."""
        out = []
        while not self._answered.empty():
            out.append(self._answered.get_nowait())
        return out

    def close(self, *, abort: bool = False) -> None:
        """End the stream (after answering what was put, unless ``abort``) and wait for it."""
        self.feed.abort() if abort else self.feed.close()
        self._thread.join()

    def _pump(self, engine: StreamingEngine) -> None:
        try:
            for result in engine.generate_stream(self.feed):
                self._answered.put((result.request_id, result.weight_version))
                with self._lock:
                    future = self._futures.pop(result.request_id)
                future.set_result(result)
        except BaseException as exc:  # noqa: BLE001 -- handed to every waiting request and the caller
            self.error = exc
        with self._lock:
            self.ended = True
            pending, self._futures = list(self._futures.values()), {}
        for future in pending:
            future.set_exception(RuntimeError(f"the engine stream ended: {self.error}"))


class Gateway:
    """The OpenAI-compatible endpoint of rollout sessions (module doc)."""

    def __init__(self, settings: GatewaySettings, *, codec: TemplateCodec, sampling: SamplingSettings) -> None:
        self.settings, self.codec, self.sampling = settings, codec, sampling
        self.sessions: dict[str, Session] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.link: EngineLink | None = None
        self.turn_s: list[float] = []  # gateway time per answered turn, engine time excluded
        self._server = self._thread = None
        self.port = settings.port

    def start(self) -> Gateway:
        """Listen (module doc); returns once the port is bound."""
        import uvicorn

        from megatron_rl.gateway.app import build_app

        config = uvicorn.Config(
            build_app(self), host=self.settings.host, port=self.settings.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="megatron_rl-gateway-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway could not listen on {self.settings.host}:{self.settings.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Stop listening (idempotent)."""
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10.0)
            self._server = None

    def base_url(self, sid: str) -> str:
        """The OpenAI base URL of session ``sid``."""
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        return f"http://{host}:{self.port}/sessions/{sid}/v1"

    def open_session(self, session: Session) -> str:
        """Register ``session``; returns its id (the path segment of its base URL)."""
        sid = secrets.token_urlsafe(16)
        self.sessions[sid] = session
        return sid

    def close_session(self, sid: str, why: str) -> Session:
        """No more requests for ``sid`` (409 from now on); returns the session."""
        session = self.sessions.pop(sid)
        session.closed = why
        return session

    def authorized(self, header: str | None) -> bool:
        """Whether a request's ``Authorization`` header carries the key (always, without one)."""
        key = self.settings.key
        return not key or secrets.compare_digest(header or "", f"Bearer {key}")

    async def chat(self, sid: str, request: ChatRequest) -> tuple[Turn, str]:
        """Answer one chat request of session ``sid``: (the turn, its completion id)."""
        session = self.sessions.get(sid)
        if session is None or session.closed:
            raise RequestError(f"no open session {sid!r}", status=404 if session is None else 409)
        lock = self._locks.setdefault(sid, asyncio.Lock())
        async with lock:
            return await self._turn(session, request)

    async def _turn(self, session: Session, request: ChatRequest) -> tuple[Turn, str]:
        start = time.perf_counter()
        plan = session.plan(request)
        eot = self.codec.end_of_turn(request.tools)
        stops = (*self.sampling.stop_token_ids, eot, *stop_ids(self.codec.tokenizer, request.stop))
        stops = tuple(dict.fromkeys(stops))
        turn = session.turns
        session.turns += 1
        sampling = replace(
            self.sampling,
            temperature=self.sampling.temperature if request.temperature is None else request.temperature,
            max_new_tokens=min(request.max_tokens or self.sampling.max_new_tokens, session.room(plan)),
            stop_token_ids=stops,
            seed=session.seed_of(turn),
        )
        rid = f"{session.key}/{turn}"
        if self.link is None:
            raise RequestError("the gateway has no engine attached (no batch is generating)", status=503)
        submitted = time.perf_counter()
        result: GenerationResult = await asyncio.wrap_future(
            self.link.submit(GenerationRequest(request_id=rid, prompt_ids=plan.prompt_ids, sampling=sampling))
        )
        answered = time.perf_counter()
        if session.closed:
            raise RequestError(f"session {session.key!r} was closed: {session.closed}", status=409)
        result = _cut(result, request.stop, self.codec.decode)
        out = self._record(session, plan, result, stops, eot=eot, turn_id=f"{turn}", stream=request.stream)
        self.turn_s.append((submitted - start) + (time.perf_counter() - answered))
        return out, f"chatcmpl-{rid.replace('/', '-')}"

    def _record(
        self,
        session: Session,
        plan: Any,
        result: GenerationResult,
        stops: tuple[int, ...],
        *,
        eot: int,
        turn_id: str,
        stream: bool,
    ) -> Turn:
        """Commit the engine's turn to the session; the turn as the API shows it."""
        ids = result.response_ids
        stopped = result.finish_reason == "stop" and bool(ids) and ids[-1] in stops
        shown = ids[:-1] if stopped else ids
        text = self.codec.decode(shown)
        content, calls, finish = assistant_turn(text, turn_id=turn_id, cut=result.finish_reason == "length")
        turn = Turn(
            text=text,
            content=content,
            tool_calls=calls,
            finish_reason=finish,
            tokens=tuple(self.codec.token_text(t) for t in ids),
            logprobs=tuple(result.logprobs),
            prompt_tokens=len(plan.prompt_ids),
            pieces=pieces(shown, self.codec.decode) if stream else (),
        )
        closed = bool(ids) and ids[-1] == eot
        session.commit(plan, result=result, text=text, assistant=recorded_message(turn), closed_turn=closed)
        return turn

    def respond(self, turn: Turn, cid: str, request: ChatRequest) -> Any:
        """The completion object, or the SSE chunks when the request streams."""
        model = request.model or self.settings.model_name
        if request.stream:
            return sse_chunks(turn, cid=cid, model=model, request=request)
        return completion(turn, cid=cid, model=model, logprobs=request.logprobs)

    def models(self) -> dict[str, Any]:
        """The ``/v1/models`` list: the policy being trained."""
        entry = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "megatron_rl"}
        return {"object": "list", "data": [entry]}

    def count_malformed(self, sid: str) -> None:
        """Count one refused request on session ``sid`` (when it is open)."""
        if sid in self.sessions:
            self.sessions[sid].malformed += 1


def _cut(result: GenerationResult, stops: tuple[str, ...], decode: Any) -> GenerationResult:
    """The engine's turn cut before the request's earliest ``stop`` string (``detok.stop_cut``):
    ids, log-probs and per-token versions alike, finish_reason "stop"; unchanged when none occurs."""
    keep = stop_cut(result.response_ids, stops, decode)
    if keep is None:
        return result
    versions = result.token_versions[:keep] if result.token_versions else None
    return replace(
        result,
        response_ids=result.response_ids[:keep],
        logprobs=result.logprobs[:keep],
        finish_reason="stop",
        token_versions=versions or None,
    )
