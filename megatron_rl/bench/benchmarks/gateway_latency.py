"""The agent gateway's added latency per turn: the real ``openai`` client against the gateway
over an engine that answers at once (a fixed reply), so what is timed is the gateway alone:
HTTP, JSON, the chat template's rendering of each turn's prompt / observation, the session's
bookkeeping. Prints one JSON line: per turn, the client's wall time (mean, p50, p90) and the
gateway's own share (engine wait excluded).

    python -m megatron_rl bench gateway_latency [--model DIR] [--sessions 8] [--turns 4]

``--model``: a tokenizer with a chat template (default: a character tokenizer with a one-line
template, no download).
"""

from __future__ import annotations

import argparse
import statistics
import time

from megatron_rl.rollout.types import GenerationResult

TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


class InstantEngine:
    """Answers every turn at once with the same reply (+ the first stop id)."""

    def __init__(self, reply: tuple[int, ...]) -> None:
        self.reply = reply

    def generate_stream(self, feed):
        """One result per request put, as soon as it is taken."""
        while True:
            feed.handle.poll(0.01)
            taken, closed, aborted = feed.take()
            for req in taken:
                ids = (*self.reply, req.sampling.stop_token_ids[0])
                yield GenerationResult(
                    request_id=req.request_id,
                    prompt_ids=req.prompt_ids,
                    response_ids=ids,
                    logprobs=(-1.0,) * len(ids),
                    finish_reason="stop",
                    weight_version=0,
                )
            if aborted or (closed and not taken):
                return


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a tokenizer directory with a chat template")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)


def _tokenizer(model: str | None):
    if model:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model)
    from megatron_rl.models.synthetic import char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def run(args: argparse.Namespace) -> dict:
    """Time ``--sessions`` x ``--turns`` chat turns through the gateway (module doc)."""
    import openai

    from megatron_rl.gateway import EngineLink, Gateway, GatewaySettings, Session, TemplateCodec
    from megatron_rl.rollout.types import SamplingSettings

    tokenizer = _tokenizer(args.model)
    codec = TemplateCodec(tokenizer)
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=64, stop_token_ids=(tokenizer.eos_token_id,))
    gateway = Gateway(GatewaySettings(), codec=codec, sampling=sampling).start()
    gateway.link = EngineLink(InstantEngine(tuple(tokenizer.encode("The answer is 42.", add_special_tokens=False))))
    walls = []
    try:
        for s in range(args.sessions):
            sid = gateway.open_session(Session(key=f"0/p/{s}", codec=codec, max_total_tokens=100_000, seed_of=int))
            client = openai.OpenAI(base_url=gateway.base_url(sid), api_key="unused", max_retries=0)
            messages = [{"role": "user", "content": "What is 6 * 7?"}]
            for t in range(args.turns):
                start = time.perf_counter()
                reply = client.chat.completions.create(model="policy", messages=messages)
                walls.append(time.perf_counter() - start)
                messages += [
                    reply.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": f"{t}"},
                ]
    finally:
        gateway.link.close()
        gateway.stop()
    walls_ms = sorted(w * 1e3 for w in walls)
    return {
        "benchmark": "gateway_latency",
        "turns": len(walls),
        "turn_ms_mean": round(statistics.fmean(walls_ms), 3),
        "turn_ms_p50": round(walls_ms[len(walls_ms) // 2], 3),
        "turn_ms_p90": round(walls_ms[int(len(walls_ms) * 0.9)], 3),
        "gateway_ms_mean": round(statistics.fmean(gateway.turn_s) * 1e3, 3),
        "first_turn_ms": round(walls[0] * 1e3, 3),
    }
