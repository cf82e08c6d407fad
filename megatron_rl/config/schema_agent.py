"""The ``agent`` section: agents written against the OpenAI chat API, run per trajectory against
the rollout gateway (``rollout.generator: agent``; ``megatron_rl.generation.agent``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Which agent runs, how many at once, for how long, and where the gateway listens."""

    # "pkg.mod:fn": fn(task, base_url) -> reward (a number) or None (then reward.fn scores the
    # last model turn); task: the prompt record's fields (prompt_id, answer, question, messages, metadata)
    run: str = ""
    workers: int = 8  # agents running at once (threads: an agent waits on I/O)
    timeout_s: float = 600.0  # one agent call; past it the trajectory ends as a counted failure
    max_total_tokens: int = 4096  # a session's prompt + model + tool tokens (longer requests are refused)
    host: str = "127.0.0.1"  # the gateway's address: loopback unless agent.key is set
    port: int = 0  # 0: a free port
    key: str | None = None  # API key every request must carry (required off loopback)
