"""One model replica (TP x PP ranks): the calls the training loop makes, run on every rank.

``Replica`` is this rank's part: ``train_micro_batch`` (tri-model forward + backward,
gradients accumulate), ``optimizer_step`` (one per mini-batch), ``sync_weights`` (hand the
new policy to the engines, then snapshot it as the next batch's old policy) and ``save``.
Every rank of the replica must make the same calls in the same order (DESIGN §5).

The replica's leader (its first rank) runs the pipeline and owns the engine pool; it drives
the replica through ``LeaderReplica``, which broadcasts each call to the other ranks before
running it. They replay the calls with ``follow`` through the ``REPLICA_CALLS`` table of
public ``Replica`` methods until the leader says stop.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.models import DecoderSpec, export_hf_tensors, save_hf_checkpoint
from megatron_rl.pipeline import MicroBatch
from megatron_rl.rollout.types import RolloutEngine
from megatron_rl.trainer.checkpoint import RunState, finalize, save_optimizer, staging_dir
from megatron_rl.trainer.policy_step import MiniBatchResult, PolicyTrainer
from megatron_rl.trainer.stop import StopRequest


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


class Replica:
    """This rank's part of a model replica; see the module docstring."""

    def __init__(self, trainer: PolicyTrainer, policy, spec: DecoderSpec, *, engine: RolloutEngine | None,
                 snapshot_root: str | Path, source_dir: str | Path, channel: ReplicaChannel,
                 weight_sync: str = "snapshot") -> None:
        self.trainer, self.policy, self.spec, self.engine = trainer, policy, spec, engine
        self.snapshot_root, self.source_dir = Path(snapshot_root), Path(source_dir)
        self.channel, self.weight_sync = channel, weight_sync
        self.stop = StopRequest()  # installed by the loop
        self.results: list[MiniBatchResult] = []
        self.seconds = {"train": 0.0, "optimizer": 0.0, "weight_sync": 0.0}  # since the last pop_results()
        self.trainer.begin_batch()

    def train_micro_batch(self, mb: MicroBatch) -> None:
        """Forward + backward of one micro-batch; gradients accumulate until ``optimizer_step``."""
        start = time.perf_counter()
        self.trainer.train_micro_batch(mb)
        self.seconds["train"] += time.perf_counter() - start

    def optimizer_step(self) -> None:
        """Normalise the accumulated gradients and step (end of a mini-batch)."""
        start = time.perf_counter()
        self.results.append(self.trainer.finish_mini_batch())
        self.seconds["optimizer"] += time.perf_counter() - start

    def sync_weights(self, version: int) -> int:
        """Hand the policy to the engines as ``version`` (a broadcast from the leader, TP shards
        gathered tensor by tensor; or a HF snapshot every PP stage writes and the engines
        reload), then snapshot it as the next batch's old policy. Returns ``version``."""
        start = time.perf_counter()
        if self.weight_sync == "broadcast":
            tensors = list(export_hf_tensors(self.policy, self.spec))  # collective over TP
            if self.engine is not None:
                self.engine.update_weights_from_tensors(tensors, version)
        else:
            snapshot = self.snapshot_root / f"v{version}"
            save_hf_checkpoint(self.policy, self.spec, snapshot, source_dir=self.source_dir)
            if self.engine is not None:
                self.engine.update_weights(str(snapshot), version)
                shutil.rmtree(self.snapshot_root / f"v{version - 2}", ignore_errors=True)  # keep two
        self.trainer.begin_batch()
        self.seconds["weight_sync"] += time.perf_counter() - start
        return version

    def save(self, path: str) -> None:
        """Write this rank's share of a checkpoint into ``path``'s staging directory."""
        staging = staging_dir(path)
        save_hf_checkpoint(self.policy, self.spec, staging / "model", source_dir=self.source_dir)
        save_optimizer(self.trainer.optimizer, staging)
        if self.channel.size > 1:
            dist.barrier(group=self.channel.group)  # every rank's optimizer file is written

    def poll_stop(self) -> bool:
        """True on every rank if any rank of the replica was asked to stop (SIGTERM / SIGINT)."""
        flag = torch.tensor([1 if self.stop.requested else 0], dtype=torch.int64)
        if self.channel.size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.channel.group)
        return bool(flag.item())

    def pop_results(self) -> tuple[list[MiniBatchResult], dict[str, float]]:
        """The optimizer steps and the seconds spent per phase since the last call."""
        out, seconds = self.results, self.seconds
        self.results, self.seconds = [], dict.fromkeys(seconds, 0.0)
        return out, seconds


# What followers may be asked to run: public Replica methods only.
REPLICA_CALLS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (Replica.train_micro_batch, Replica.optimizer_step, Replica.sync_weights, Replica.save, Replica.poll_stop)
}


class LeaderReplica:
    """The replica as its leader drives it: every call is sent to the followers, then run here."""

    def __init__(self, replica: Replica) -> None:
        self.replica, self.channel = replica, replica.channel

    def train_micro_batch(self, mb: MicroBatch) -> None:
        self._call("train_micro_batch", mb)

    def optimizer_step(self) -> None:
        self._call("optimizer_step")

    def sync_weights(self, version: int) -> int:
        return self._call("sync_weights", version)

    def save_checkpoint(self, path: str | Path, state: RunState) -> Path:
        """Write a resumable checkpoint at ``path`` (collective over the replica); see ``checkpoint``."""
        shutil.rmtree(staging_dir(path), ignore_errors=True)
        self._call("save", str(path))
        return finalize(staging_dir(path), state)

    def poll_stop(self) -> bool:
        return self._call("poll_stop")

    def pop_results(self) -> tuple[list[MiniBatchResult], dict[str, float]]:
        return self.replica.pop_results()

    def stop_followers(self) -> None:
        self.channel.send(("stop", ()))

    def _call(self, name: str, *args: Any) -> Any:
        self.channel.send((name, args))
        return REPLICA_CALLS[name](self.replica, *args)


def follow(replica: Replica) -> None:
    """Non-leader ranks: replay the leader's calls until it says stop."""
    while True:
        name, args = replica.channel.recv()
        if name == "stop":
            return
        if name not in REPLICA_CALLS:
            raise RuntimeError(f"unknown replica call {name!r}")
        REPLICA_CALLS[name](replica, *args)
