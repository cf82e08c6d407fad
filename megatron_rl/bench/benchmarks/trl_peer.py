"""TRL's ``GRPOTrainer`` on a megatron_rl config's workload: the peer run of the ``throughput`` benchmark.

    python -m megatron_rl bench trl_peer CONFIG [a.b=c ...] --steps 4 --threads 2

Same model (``model.hf_path``, in ``model.dtype``), the same prompts (``data``: source, options,
instruction, chat template, through megatron_rl's own loader), the same reward function
(``reward.fn``), G (``control.group_size``), prompts per step (``trainer.prompts_per_batch``),
completion length, sampling temperature / top-p, learning rate, clip range, grad clip, loss
aggregation (``grpo``: per-sequence mean) and no KL. Generation is TRL's own (transformers
``generate``, no vLLM). Prints one JSON line: per-step wall seconds and completion tokens.
Needs TRL (the ``test`` extra), imported only when the benchmark runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch


def build_dataset(cfg):
    """(TRL dataset of conversational prompts with an ``idx`` column, the prompt records)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from megatron_rl.data.tokenization import render_chat
    from megatron_rl.trainer import from_config

    d = cfg.data
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    prompts, _ = from_config.prompts(cfg, tokenizer)
    records = [p.record for p in prompts]

    def prompt(record):  # what megatron_rl tokenizes: the chat, or (no chat template) its one user turn
        chat = [{"role": m.role, "content": m.content} for m in render_chat(record, instruction=d.instruction)]
        return chat if d.chat_template else chat[0]["content"]

    rows = [{"prompt": prompt(r), "idx": i} for i, r in enumerate(records)]
    return Dataset.from_list(rows), records, tokenizer


class StepClock:
    """A ``TrainerCallback`` keeping each optimizer step's wall seconds and TRL's logged metrics."""

    def __init__(self) -> None:
        self.marks, self.logs = [time.perf_counter()], []

    def callback(self):
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.marks.append(time.perf_counter())

            def on_log(self, args, state, control, logs=None, **kwargs):
                clock.logs.append(dict(logs or {}))

        return _Callback()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags: config and overrides, steps, torch threads."""
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores)")


def run(args: argparse.Namespace) -> dict:
    """Load the config and train TRL on its workload; per-step seconds and completion tokens."""
    torch.set_num_threads(args.threads)
    from megatron_rl.config import load_config

    return train_trl(load_config(args.config, args.overrides), steps=args.steps)


def train_trl(cfg, *, steps: int) -> dict:
    """Train ``steps`` TRL GRPO steps on ``cfg``'s workload; per-step seconds and completion tokens."""
    from trl import GRPOTrainer

    dataset, records, tokenizer = build_dataset(cfg)
    clock = StepClock()
    trainer = GRPOTrainer(
        model=cfg.model.hf_path,
        reward_funcs=_reward(cfg, records),
        args=grpo_config(cfg, steps=steps),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock.callback()],
    )
    clock.marks = [time.perf_counter()]
    trainer.train()
    step_s = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    lengths = [log["completions/mean_length"] for log in clock.logs if "completions/mean_length" in log]
    rewards = [log["reward"] for log in clock.logs if "reward" in log]
    g, prompts = cfg.control.group_size, cfg.trainer.prompts_per_batch
    return {
        "step_s": step_s,
        "completion_tokens": [m * prompts * g for m in lengths],
        "reward": rewards,
        "trl": __import__("trl").__version__,
    }


def _reward(cfg, records):
    """TRL's reward function: the config's ``reward.fn`` on each completion's prompt record."""
    from megatron_rl.trainer.from_config import reward_fn

    score = reward_fn(cfg)

    def reward(completions, idx, **_):
        return [
            float(score(records[i], c[-1]["content"] if isinstance(c, list) else c))
            for c, i in zip(completions, idx, strict=True)
        ]

    return reward


def grpo_config(cfg, *, steps: int):
    """TRL's ``GRPOConfig`` matching ``cfg``: batch, sampling, optimizer, clip, loss, no KL."""
    from trl import GRPOConfig

    g, prompts, s = cfg.control.group_size, cfg.trainer.prompts_per_batch, cfg.rollout.sampling
    return GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_peer_"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        per_device_train_batch_size=prompts * g,
        num_generations=g,
        gradient_accumulation_steps=1,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        learning_rate=cfg.trainer.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=cfg.trainer.weight_decay,
        adam_beta1=cfg.trainer.adam_beta1,
        adam_beta2=cfg.trainer.adam_beta2,
        adam_epsilon=cfg.trainer.adam_eps,
        max_grad_norm=cfg.trainer.grad_clip,
        beta=cfg.algorithm.kl.coef,
        loss_type="grpo",
        epsilon=cfg.algorithm.clip.low,
        epsilon_high=cfg.algorithm.clip.high,
        scale_rewards="group",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        seed=cfg.trainer.seed,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": getattr(torch, cfg.model.dtype)},
    )
