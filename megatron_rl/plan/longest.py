"""The longest answer a device fits per `plan`, at given context-parallel sizes.

Contract: `longest_answer(cfg, cp=…, nodes=…, devices_per_node=…, device=…)` is the largest L
(tokens) such that the plan of `cfg` with ``parallel.cp`` = cp, ``rollout.sampling.max_new_tokens``
= L and ``pipeline.micro_batch_tokens`` = ``data.max_prompt_tokens`` + L (one prompt and one
answer per micro-batch: the least a run with such answers must hold) fits the device; 0 when
not even one token does. Everything else (tp, pp, recompute, log-prob chunks, devices) is the
config's. Memory grows with L, so a binary search finds it. `longest_answer_json` is the one
JSON line ``tools/longest_answer.py --cp 1,4`` prints.
"""

from __future__ import annotations

import dataclasses
import json

from megatron_rl.config.schema import Config
from megatron_rl.plan.build import build_plan

CEILING = 1 << 20  # 1M tokens: the search's upper end


def with_answer(cfg: Config, *, cp: int, answer: int) -> Config:
    """`cfg` at ``parallel.cp`` = `cp` with answers of `answer` tokens, one per micro-batch."""
    return dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, cp=cp),
        rollout=dataclasses.replace(
            cfg.rollout, sampling=dataclasses.replace(cfg.rollout.sampling, max_new_tokens=answer)
        ),
        pipeline=dataclasses.replace(cfg.pipeline, micro_batch_tokens=cfg.data.max_prompt_tokens + answer),
    )


def longest_answer(cfg: Config, *, cp: int, nodes: int, devices_per_node: int, device: str) -> int:
    """The longest answer (tokens) whose plan fits at ``parallel.cp`` = `cp` (see the module doc)."""

    def fits(answer: int) -> bool:
        plan = build_plan(
            with_answer(cfg, cp=cp, answer=answer), nodes=nodes, devices_per_node=devices_per_node, device=device
        )
        return plan.fits

    low, high = 0, CEILING  # fits(low) holds (0: nothing asked), fits(high) is assumed not to
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def longest_answer_json(
    cfg: Config, cps: list[int], *, source: str, nodes: int, devices_per_node: int, device: str
) -> str:
    """One JSON line: the longest answer per CP size in `cps`, and what it was computed for."""
    found = {
        str(c): longest_answer(cfg, cp=c, nodes=nodes, devices_per_node=devices_per_node, device=device) for c in cps
    }
    return json.dumps(
        {
            "metric": "longest_answer_tokens",
            "config": source,
            "device": device,
            "nodes": nodes,
            "devices_per_node": devices_per_node,
            "tp": cfg.parallel.tp,
            "pp": cfg.parallel.pp,
            "prompt_tokens": cfg.data.max_prompt_tokens,
            "micro_batch": "one prompt + one answer",
            "longest_answer_tokens": found,
        }
    )
