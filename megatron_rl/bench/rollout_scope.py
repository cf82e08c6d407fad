"""``--scope rollout``: the engines alone (``rollout.build_engine``) on the config's prompts.

Each step draws ``trainer.prompts_per_batch`` prompts from the dataset (as the pipeline does),
sends G = ``control.group_size`` seeded requests per prompt to the engine pool in one call,
and scores every result with the config's reward function as it arrives. No training, no
weight sync. Runs on global rank 0 only (engines are never training ranks).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections import defaultdict

from megatron_rl.bench.flops import GroupShape
from megatron_rl.bench.options import BenchOptions, resolve_peak
from megatron_rl.bench.result import BenchResult, StepMeasure, aggregate
from megatron_rl.config import Config, config_to_dict
from megatron_rl.data import PromptStream
from megatron_rl.pipeline import request_id, request_seed
from megatron_rl.platform.device import detect_platform
from megatron_rl.rollout import GenerationRequest, build_engine
from megatron_rl.trainer import from_config
from megatron_rl.trainer.build import DTYPES


def run_rollout_scope(cfg: Config, opts: BenchOptions) -> BenchResult | None:
    """Generate and score ``warmup + steps`` batches; the result (rank 0), None on other ranks."""
    if os.environ.get("RANK", "0") != "0":  # under torchrun: no process group here, rank 0 alone runs
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    d = cfg.data
    prompts, _ = from_config.prompts(cfg, tokenizer)
    stream = PromptStream(prompts, prompts_per_batch=cfg.trainer.prompts_per_batch, seed=d.seed)
    sampling, reward = from_config.sampling_settings(cfg, tokenizer), from_config.reward_fn(cfg)
    settings = from_config.engine_settings(cfg)
    engine = build_engine(settings)
    measured = []
    try:
        for step in range(opts.warmup + opts.steps):
            items = stream.next_batch()
            start = time.perf_counter()
            requests = [GenerationRequest(request_id=request_id(step, it.record.prompt_id, k), prompt_ids=it.token_ids,
                                          sampling=dataclasses.replace(sampling, seed=request_seed(
                                              cfg.rollout.sampling.seed, step, it.record.prompt_id, k)))
                        for it in items for k in range(cfg.control.group_size)]
            records = {it.record.prompt_id: it.record for it in items}
            lengths: dict[str, list[int]] = defaultdict(list)
            prompt_lens, reward_s, sent = {}, 0.0, time.perf_counter()
            for result in engine.generate(requests):
                pid = result.request_id.split("/")[1]
                t = time.perf_counter()
                reward(records[pid], tokenizer.decode(result.response_ids, skip_special_tokens=True))
                reward_s += time.perf_counter() - t
                lengths[pid].append(len(result.response_ids))
                prompt_lens[pid] = len(result.prompt_ids)
            end = time.perf_counter()
            groups = tuple(GroupShape(prompt_len=prompt_lens[p], response_lens=tuple(lengths[p])) for p in lengths)
            measured.append(StepMeasure(step_s=end - start, phases={"generation": end - sent - reward_s,
                                                                    "reward": reward_s}, groups=groups))
    finally:
        engine.shutdown()
    device_type = detect_platform(opts.platform).device_type
    engines = len(settings.device_assignments())
    world = {"platform": device_type, "world_size": 0, "engines": engines, "engine": cfg.rollout.engine,
             "engine_tp": cfg.rollout.tensor_parallel_size}
    # Engines are processes of their own: after shutdown, RUSAGE_CHILDREN holds the largest one's peak.
    memory = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6, "engine_host_rss")
    return aggregate(measured[opts.warmup:], scope="rollout", warmup=opts.warmup,
                     devices=engines * cfg.rollout.tensor_parallel_size, train_devices=1,
                     peak=resolve_peak(opts, device_type, DTYPES[cfg.model.dtype]), memory=memory, world=world,
                     config=config_to_dict(cfg))
