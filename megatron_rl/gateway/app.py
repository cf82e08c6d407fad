"""The FastAPI routes of the gateway: ``/sessions/<id>/v1/chat/completions`` and
``/sessions/<id>/v1/models``; every error as OpenAI's error JSON (``server`` module doc)."""

import json
import logging
from typing import Any

from megatron_rl.gateway.openai_format import RequestError, parse_request

log = logging.getLogger(__name__)


def build_app(gateway: Any) -> Any:
    """The ASGI app serving ``gateway`` (a ``server.Gateway``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="megatron_rl agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(RequestError(f"{request.url.path}: {exc.detail}", status=exc.status_code))

    @app.get("/sessions/{sid}/v1/models")
    async def models(sid: str, request: Request) -> JSONResponse:
        if not gateway.authorized(request.headers.get("authorization")):
            return _error(RequestError("missing or wrong API key", status=401))
        if sid not in gateway.sessions:
            return _error(RequestError(f"no open session {sid!r}", status=404))
        return JSONResponse(gateway.models())

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def chat(sid: str, request: Request) -> Any:
        return await answer(gateway, sid, request)

    return app


def _error(err: RequestError) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(err.body(), status_code=err.status)


async def answer(gateway: Any, sid: str, request: Any) -> Any:
    """One ``/chat/completions`` request: the completion (or its SSE stream), or an error body."""
    from fastapi.responses import JSONResponse, StreamingResponse

    if not gateway.authorized(request.headers.get("authorization")):
        return _error(RequestError("missing or wrong API key", status=401))
    try:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RequestError(f"the request body is not JSON: {err}", param="body") from err
        parsed = parse_request(body)
        turn, cid = await gateway.chat(sid, parsed)
    except RequestError as err:
        gateway.count_malformed(sid)
        return _error(err)
    except Exception as exc:  # noqa: BLE001 -- any failure is this request's, never the server's
        log.exception("gateway: request of session %s failed", sid)
        gateway.count_malformed(sid)
        return _error(RequestError(f"{type(exc).__name__}: {exc}", status=500))
    out = gateway.respond(turn, cid, parsed)
    if parsed.stream:
        return StreamingResponse(out, media_type="text/event-stream")
    return JSONResponse(out)
