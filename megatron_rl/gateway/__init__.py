"""Agent gateway: an OpenAI-compatible /v1/chat/completions per rollout session, token in / token out.

Modules: `openai_format` (the wire format: requests checked, completions and SSE chunks, error
bodies, tool calls in OpenAI's format), `detok` (stop strings cut from a turn's ids, each
token's piece of text for streaming), `session` (a session's branches: the engine's exact ids,
log-probs and weight versions per turn, observations through the chat template), `server`
(``Gateway``: uvicorn in a thread, sessions by URL, the key rule; ``EngineLink``: the sessions'
turns on one engine stream), `app` (the FastAPI routes). ``generation.agent`` runs users'
agents against it.
"""

from megatron_rl.gateway.openai_format import ChatRequest, RequestError, Turn, parse_request
from megatron_rl.gateway.server import EngineLink, Gateway, GatewaySettings
from megatron_rl.gateway.session import Branch, Session, TemplateCodec

__all__ = [
    "Branch",
    "ChatRequest",
    "EngineLink",
    "Gateway",
    "GatewaySettings",
    "RequestError",
    "Session",
    "TemplateCodec",
    "Turn",
    "parse_request",
]
