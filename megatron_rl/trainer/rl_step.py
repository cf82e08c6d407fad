"""The pipeline's ``TrainerStep`` on a (TP x PP) model replica: train micro-batches, step, sync.

The replica's leader (its first rank, which runs the producer and owns the engine pool)
receives micro-batches from ``megatron_rl.pipeline`` and broadcasts every call to the other
ranks of its model-parallel group, which replay them in the same order (``follow``), so all
TP ranks and PP stages see the same micro-batches (DESIGN §5).

After a batch's last micro-batch: optimizer step, weight snapshot (HF safetensors, written by
every PP stage, atomically), ``engine.update_weights`` on the leader, and the next batch's
old-policy snapshot. With ``mini_batches > 1`` the optimizer also steps inside the batch,
each time another share of the batch's groups has been trained.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rl.models import DecoderSpec, export_hf_tensors, save_hf_checkpoint
from megatron_rl.pipeline import BatchSummary, MicroBatch
from megatron_rl.rollout.types import RolloutEngine
from megatron_rl.trainer.checkpoint import RunState, finalize, save_optimizer, staging_dir
from megatron_rl.trainer.policy_step import MiniBatchResult, PolicyTrainer


class ReplicaChannel:
    """Leader -> followers of this rank's model-parallel group (TP x PP ranks of one replica)."""

    def __init__(self) -> None:
        from megatron.core import parallel_state as ps

        self.group = ps.get_model_parallel_group()
        self.src = ps.get_model_parallel_src_rank()
        self.size = dist.get_world_size(self.group)
        self.is_leader = dist.get_rank() == self.src

    def send(self, message: tuple[str, Any]) -> None:
        if self.size > 1:
            dist.broadcast_object_list([message], src=self.src, group=self.group)

    def recv(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


class RLStep:
    """Implements ``pipeline.TrainerStep`` for one replica (see the module docstring)."""

    def __init__(self, trainer: PolicyTrainer, policy, spec: DecoderSpec, *, engine: RolloutEngine | None,
                 snapshot_root: str | Path, source_dir: str | Path, groups_per_mini_batch: int | None,
                 channel: ReplicaChannel, weight_sync: str = "snapshot") -> None:
        self.trainer, self.policy, self.spec, self.engine = trainer, policy, spec, engine
        self.snapshot_root, self.source_dir = Path(snapshot_root), Path(source_dir)
        self.groups_per_mini_batch = groups_per_mini_batch
        self.channel = channel
        self.weight_sync = weight_sync
        self.results: list[MiniBatchResult] = []
        self.seconds = {"train": 0.0, "weight_sync": 0.0}  # since the last pop_results()
        self._groups_since_step = 0
        self.trainer.begin_batch()

    # -- TrainerStep (called on the leader by the pipeline) -------------------------------
    def train_micro_batch(self, mb: MicroBatch) -> None:
        self.channel.send(("train", mb))
        self._train(mb)

    def finish_batch(self, summary: BatchSummary) -> int:
        self.channel.send(("finish", summary.policy_version))
        return self._finish(summary.policy_version)

    def save_checkpoint(self, path: str | Path, state: RunState) -> Path:
        """Write a resumable checkpoint at ``path`` (collective over the replica); see ``checkpoint``."""
        shutil.rmtree(staging_dir(path), ignore_errors=True)
        self.channel.send(("checkpoint", str(path)))
        self._save(str(path))
        return finalize(staging_dir(path), state)

    def stop_followers(self) -> None:
        self.channel.send(("stop", None))

    # -- executed identically on every rank of the replica ----------------------------------
    def _train(self, mb: MicroBatch) -> None:
        start = time.perf_counter()
        self.trainer.train_micro_batch(mb)
        self._groups_since_step += len(mb.groups)
        if self.groups_per_mini_batch and self._groups_since_step >= self.groups_per_mini_batch:
            self.results.append(self.trainer.finish_mini_batch())
            self._groups_since_step = 0
        self.seconds["train"] += time.perf_counter() - start

    def _finish(self, version: int) -> int:
        start = time.perf_counter()
        if self._groups_since_step > 0 or not self.results:
            self.results.append(self.trainer.finish_mini_batch())
        self._groups_since_step = 0
        synced = time.perf_counter()
        self.seconds["train"] += synced - start
        new_version = version + 1
        self._sync_weights(new_version)
        self.trainer.begin_batch()
        self.seconds["weight_sync"] += time.perf_counter() - synced
        return new_version

    def _sync_weights(self, version: int) -> None:
        """Hand the new policy weights to the engines: a broadcast from the leader (TP shards
        gathered tensor by tensor), or a HF snapshot every PP stage writes and the engines reload."""
        if self.weight_sync == "broadcast":
            tensors = list(export_hf_tensors(self.policy, self.spec))  # collective over TP
            if self.engine is not None:
                self.engine.update_weights_from_tensors(tensors, version)
            return
        snapshot = self.snapshot_root / f"v{version}"
        save_hf_checkpoint(self.policy, self.spec, snapshot, source_dir=self.source_dir)
        if self.engine is not None:
            self.engine.update_weights(str(snapshot), version)
            shutil.rmtree(self.snapshot_root / f"v{version - 2}", ignore_errors=True)  # keep two

    def _save(self, path: str) -> None:
        staging = staging_dir(path)
        save_hf_checkpoint(self.policy, self.spec, staging / "model", source_dir=self.source_dir)
        save_optimizer(self.trainer.optimizer, staging)
        if self.channel.size > 1:
            dist.barrier(group=self.channel.group)  # every rank's optimizer file is written

    def pop_results(self) -> tuple[list[MiniBatchResult], dict[str, float]]:
        """The optimizer steps and the seconds spent training / syncing since the last call."""
        out, seconds = self.results, self.seconds
        self.results, self.seconds = [], {"train": 0.0, "weight_sync": 0.0}
        return out, seconds


def follow(step: RLStep) -> None:
    """Non-leader ranks: replay the leader's calls until it says stop."""
    while True:
        kind, payload = step.channel.recv()
        if kind == "train":
            step._train(payload)
        elif kind == "finish":
            step._finish(payload)
        elif kind == "checkpoint":
            step._save(payload)
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown replica message {kind!r}")
