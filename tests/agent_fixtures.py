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


_CALLS = iter(range(10**9))  # next() is atomic under the GIL: each call gets its own number


def counting_agent(task, base_url):
    """Behaves by call number (n % 5): 0 crashes after a turn; 1 sends a malformed request
    (temperature 9: a 400) and goes on; 2 starts a second branch (a fresh conversation); 3
    sleeps 300 s (past agent.timeout_s) after a turn; 4 takes two turns. Appends what it did,
    seen from the client (turns of its last branch, branches, refused requests, tool calls in
    the replies, how it ended), as a JSON line to $AGENT_LOG; returns None (reward.fn scores)."""
    import json
    import os
    import time

    import openai

    n, seen = next(_CALLS) % 5, {"turns": 0, "branches": 1, "malformed": 0, "tool_calls": 0, "ended": "ok"}
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(task["messages"])

    def turn(msgs, **extra):
        reply = client.chat.completions.create(model="policy", messages=msgs, **extra).choices[0].message
        seen["turns"] += 1
        seen["tool_calls"] += len(reply.tool_calls or [])
        return reply

    def log(ended):
        with open(os.environ["AGENT_LOG"], "a") as f:
            f.write(json.dumps({**seen, "ended": ended}) + "\n")

    first = turn(messages)
    if n == 0:
        log("crashed")
        raise RuntimeError("the agent crashed")
    if n == 1:
        try:
            turn(messages, temperature=9)
        except openai.BadRequestError:
            seen["malformed"] += 1
    if n == 3:
        log("timed_out")
        time.sleep(300.0)
        return None
    if n == 2:
        seen["turns"], seen["branches"] = 0, 2
        turn([{"role": "user", "content": "start over"}])
    else:
        turn([*messages, first.model_dump(exclude_none=True), {"role": "tool", "content": "= 1"}])
    log("ok")
    return None
