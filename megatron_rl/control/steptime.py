"""Wall-clock of one RL step from its response lengths, in the sync and periodic modes (DESIGN §1).

Generation. Every request of the step starts at once in one continuous batch; decode iteration k
(k = 1, 2, ...) advances every response still running, n_k = #{j : L_j >= k} of them, and costs
`decode_iter_s + decode_seq_s * n_k` (a fixed, latency-bound part: reading the weights, launch
overheads; plus a part per running sequence: its KV cache, its share of the compute). Response i
is finished after iteration L_i, at

    f(L_i) = sum_{k <= L_i} (decode_iter_s + decode_seq_s * n_k)
           = decode_iter_s * L_i + decode_seq_s * sum_j min(L_j, L_i),

and the whole batch at T_gen = f(max L) = decode_iter_s * max L + decode_seq_s * sum L: the
longest response (the straggler) sets the first term. A group of G responses is finished at
f(longest response of the group).

Training. A group costs train_token_s x its tokens (G x prompt_tokens + its response tokens:
each response packed with its own copy of the prompt, as the paper's baselines do); the optimizer
step plus weight sync cost `sync_s` once per step.

  sync      step = T_gen + T_train(all groups) + sync_s: train after the whole batch is generated.
  periodic  the trainer (one server) takes the groups in the order they finish and trains each at
            once: start_g = max(finish_g, end of the previous group), end_g = start_g + train_g;
            step = end of the last group + sync_s. So step ~ T_gen + T_train(last groups) + sync_s:
            only training overlaps with generation, the straggler still bounds the step.
Trainer and engines are separate devices (DESIGN §1), so generation never waits for training
inside a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class StepTimeModel:
    """Cost constants of one step; every field in seconds (see the module docstring)."""

    decode_iter_s: float  # cost of one decode iteration, independent of how many sequences run
    decode_seq_s: float  # extra cost per running sequence per decode iteration
    train_token_s: float  # forward + backward (+ reference forward) per trained token
    sync_s: float  # optimizer step + weight sync, once per step
    prompt_tokens: int  # tokens of each prompt copy trained with a response

    def __post_init__(self) -> None:
        for name in ("decode_iter_s", "decode_seq_s", "train_token_s", "sync_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepTimeModel.{name} must be >= 0, got {getattr(self, name)!r}")
        if self.prompt_tokens < 0:
            raise ValueError(f"StepTimeModel.prompt_tokens must be >= 0, got {self.prompt_tokens!r}")

    def finish_times(self, lengths: np.ndarray) -> np.ndarray:
        """f(L_i) for every response: time at which response i is finished, same shape as lengths."""
        flat = np.asarray(lengths, dtype=np.float64).ravel()
        order = np.sort(flat)
        below = np.concatenate([[0.0], np.cumsum(order)])  # below[k] = sum of the k smallest
        k = np.searchsorted(order, flat, side="right")  # how many L_j <= L_i
        sum_min = below[k] + flat * (flat.size - k)  # sum_j min(L_j, L_i)
        out = self.decode_iter_s * flat + self.decode_seq_s * sum_min
        return out.reshape(np.shape(lengths))

    def generation_seconds(self, lengths: np.ndarray) -> float:
        """T_gen = decode_iter_s * max L + decode_seq_s * sum L."""
        flat = np.asarray(lengths, dtype=np.float64)
        return float(self.decode_iter_s * flat.max() + self.decode_seq_s * flat.sum())

    def train_seconds(self, group_lengths: np.ndarray) -> float:
        """Training time of one group (G,): train_token_s x (G x prompt_tokens + sum of lengths)."""
        g = np.asarray(group_lengths, dtype=np.float64)
        return float(self.train_token_s * (g.size * self.prompt_tokens + g.sum()))

    def sync_step_seconds(self, lengths: np.ndarray) -> float:
        """Synchronous step: T_gen + T_train(every group) + sync_s; lengths (prompts, G)."""
        lengths = np.asarray(lengths)
        train = sum(self.train_seconds(group) for group in lengths)
        return self.generation_seconds(lengths) + train + self.sync_s

    def periodic_step_seconds(self, lengths: np.ndarray) -> float:
        """Periodic step: groups trained in finishing order as they finish, then sync_s;
        lengths (prompts, G)."""
        lengths = np.asarray(lengths)
        finish = self.finish_times(lengths).max(axis=1)  # a group is done with its longest response
        clock = 0.0
        for g in np.argsort(finish, kind="stable"):
            clock = max(clock, float(finish[g])) + self.train_seconds(lengths[g])
        return clock + self.sync_s

    def scaled(self, factor: float) -> StepTimeModel:
        """The same model with every time constant multiplied by `factor`."""
        return StepTimeModel(
            decode_iter_s=self.decode_iter_s * factor,
            decode_seq_s=self.decode_seq_s * factor,
            train_token_s=self.train_token_s * factor,
            sync_s=self.sync_s * factor,
            prompt_tokens=self.prompt_tokens,
        )
