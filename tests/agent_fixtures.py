"""Agents for tests and the config-leaves run, written as plain ``openai`` client code."""

from __future__ import annotations


def two_turn_agent(task, base_url):
    """Deterministic: one model turn, a fixed tool result, a second model turn; returns None
    (the run's reward.fn scores the last turn). No tool schemas: the prompt stays short."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(task["messages"])
    reply = client.chat.completions.create(model="policy", messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "= 1"}]
    client.chat.completions.create(model="policy", messages=messages)
    return None
