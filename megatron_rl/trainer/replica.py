"""One model replica (TP x PP ranks): the calls the training loop makes, run on every rank.

``Replica`` is this rank's part: ``train_micro_batch`` (tri-model forward + backward,
gradients accumulate), ``optimizer_step`` (one per mini-batch), ``sync_weights`` (hand the
new policy to the engines, then snapshot it as the next batch's old policy) and ``save``.
Every rank of the replica must make the same calls in the same order (DESIGN §5).

Global rank 0 (the leader of replica 0) runs the pipeline and owns the engine pool; it drives
the replicas through ``LeaderReplica``, which broadcasts each call to the other ranks of its
replica before running it, and at DP > 1 sends it to the other replicas' leaders too
(``data_parallel``; a micro-batch goes to the one replica it was routed to). The other ranks
replay the calls with ``follow`` through the ``REPLICA_CALLS`` table of public ``Replica``
methods until rank 0 says stop. A follower's wait for the next call is bounded by
``parallel.timeout_s`` (``parallel.world_timeout``); when rank 0 itself gives up waiting for
generation, it sends ``abort`` with its reason, and every follower raises it too.

A micro-batch for another replica travels without its ``groups`` (the ``Sample`` records it was
packed from): the replica trains on the packed tensors, advantages, behaviour log-probs and
versions alone, so the tokens cross the wire once. Hence ``attention.shared_prompt: false`` is
applied here, on rank 0, before a micro-batch is trained or sent (``unshare_prompts`` rebuilds
the K-copies layout from the groups, each prompt copy with its own sample's MoE routes): every
rank of every replica receives the layout it trains.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.config.schema import WeightSync
from megatron_rl.models import DecoderSpec
from megatron_rl.parallel.world_timeout import WorldTimeout, current_timeout_s, follower_timeout
from megatron_rl.pipeline import MicroBatch
from megatron_rl.pipeline.records import unshare_prompts
from megatron_rl.rollout.types import RolloutEngine
from megatron_rl.trainer.checkpoint import RunState, finalize, save_policy, staging_dir
from megatron_rl.trainer.data_parallel import DispatchChannel
from megatron_rl.trainer.engine_probe import EngineProbe, ProbeInput, measure_probe
from megatron_rl.trainer.policy_step import MiniBatchResult, PolicyTrainer
from megatron_rl.trainer.policy_weights import PolicyWeights, stage_place
from megatron_rl.trainer.stop import StopRequest
from megatron_rl.trimodel.routing import require_routes
from megatron_rl.weight_sync import SenderSetup, build_sender


class ReplicaChannel:
    """Leader -> followers of this rank's replica (TP x PP x CP ranks)."""

    def __init__(self) -> None:
        from megatron_rl.parallel.state import host_model_parallel_group, replica_src_rank

        self.group = host_model_parallel_group()  # pickled calls are host data: gloo, never NCCL / HCCL
        self.src = replica_src_rank()  # TP x PP x CP ranks of one replica
        self.size = dist.get_world_size(self.group)
        self.is_leader = dist.get_rank() == self.src

    def send(self, message: tuple[str, Any]) -> None:
        if self.size > 1:
            dist.broadcast_object_list([message], src=self.src, group=self.group)

    def recv(self) -> tuple[str, Any]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncSettings:
    """How a replica hands its weights to the engines (``rollout.weight_sync``, ``rollout.sync_bucket_mb``)."""

    weight_sync: WeightSync  # a ``megatron_rl.weight_sync`` transport
    bucket_mb: int  # broadcast: tensors travel packed in flat buckets of this many MiB


class Replica:
    """This rank's part of a model replica; see the module docstring."""

    def __init__(
        self,
        trainer: PolicyTrainer,
        policy,
        spec: DecoderSpec,
        *,
        engine: RolloutEngine | None,
        snapshot_root: str | Path,
        source_dir: str | Path,
        channel: ReplicaChannel,
        sync: SyncSettings,
        dispatch: DispatchChannel | None = None,
        save_merged: bool = False,
    ) -> None:
        """``sync``: the weight transport, its sender built here once; ``dispatch``: rank 0 -> the
        other replicas' leaders (DP > 1), else None; ``save_merged``: a LoRA checkpoint also holds
        the merged model (``lora.save_merged``)."""
        self.trainer, self.policy, self.spec, self.engine = trainer, policy, spec, engine
        self.save_merged = save_merged
        self.snapshot_root, self.source_dir = Path(snapshot_root), Path(source_dir)
        self.channel, self.dispatch = channel, dispatch
        self.weights = PolicyWeights(policy, spec, source_dir)
        self.sender = build_sender(
            sync.weight_sync,
            SenderSetup(
                source=self.weights,
                engine=engine,
                channel=channel,
                place=stage_place(),
                scratch=self.snapshot_root,
                bucket_bytes=sync.bucket_mb << 20,
            ),
        )
        self.stop = StopRequest()  # installed by the loop
        self.results: list[MiniBatchResult] = []
        self.probe: EngineProbe | None = None  # the leader's engine probe, when on (set by trainer.setup)
        self.probe_log: dict[str, float] = {}  # the last probe's metrics (trainer.engine_probe), until popped
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
        """Hand the policy to the engines as ``version`` (this rank's part of the sender's
        ``sync``, ``megatron_rl.weight_sync``), then snapshot it as the next batch's old
        policy. Adds to ``seconds``: ``weight_sync`` (all of it), ``weight_sync_transfer`` (the
        hand-over alone) and ``weight_sync_bytes`` (bytes of the HF tensors handed over; GB/s =
        bytes / 1e9 / transfer). Returns ``version``."""
        start = time.perf_counter()
        stats = self.sender.sync(version)
        transfer = time.perf_counter() - start
        self.trainer.begin_batch()
        self.seconds["weight_sync"] += time.perf_counter() - start
        for key, value in (("weight_sync_transfer", transfer), ("weight_sync_bytes", float(stats.nbytes))):
            self.seconds[key] = self.seconds.get(key, 0.0) + value
        return version

    def prime_engines(self, version: int) -> None:
        """Before the engines first generate (every rank of the world, as ``sync_weights``): with a
        LoRA policy, hand them its merged adapted layers as their current ``version``. They start
        from the base checkpoint, so at a resumed step (or with adapters loaded at start) they
        would otherwise generate with the base weights. A no-op for a full fine-tune, whose
        engines start from the policy's own weights."""
        if self.weights.partial:
            self.sender.sync(version)

    def probe_engine(self, probe: ProbeInput) -> None:
        """Compare the engines' scores of the probe with the policy's (``trainer.engine_probe``;
        collective over the world, the mismatch alarm applied)."""
        start = time.perf_counter()
        self.probe_log = measure_probe(self.trainer, probe)
        self.seconds["probe"] = self.seconds.get("probe", 0.0) + time.perf_counter() - start + probe.engine_s

    def save(self, path: str) -> None:
        """Write this rank's share of a checkpoint into ``path``'s staging directory: weights (LoRA:
        the adapters, PEFT's format) and optimizer state per HF / PEFT name, so any layout can
        resume it (``checkpoint.save_policy``; collective over the world)."""
        staging, optimizer = staging_dir(path), self.trainer.optimizer
        save_policy(
            optimizer, self.policy, self.spec, staging, source_dir=self.source_dir, save_merged=self.save_merged
        )
        if dist.get_world_size() > 1:
            dist.barrier()  # every rank's files are written

    def poll_stop(self) -> bool:
        """True on every rank if any rank of the world was asked to stop (SIGTERM / SIGINT)."""
        from megatron_rl.parallel.state import host_world_group

        flag = torch.tensor([1 if self.stop.requested else 0], dtype=torch.int64)  # a host flag: host group
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=host_world_group())
        return bool(flag.item())

    def pop_results(self) -> tuple[list[MiniBatchResult], dict[str, float]]:
        """The optimizer steps and the seconds spent per phase since the last call."""
        out, seconds = self.results, self.seconds | self.probe_log
        self.probe_log = {}
        self.results, self.seconds = [], dict.fromkeys(seconds, 0.0)
        return out, seconds


# What followers may be asked to run: public Replica methods only.
REPLICA_CALLS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        Replica.train_micro_batch,
        Replica.optimizer_step,
        Replica.sync_weights,
        Replica.save,
        Replica.poll_stop,
        Replica.probe_engine,
    )
}


class LeaderReplica:
    """The replicas as rank 0 drives them: every call is sent to the followers (and the other
    replicas' leaders), then run here; a micro-batch only where it was routed."""

    def __init__(self, replica: Replica) -> None:
        self.replica, self.channel, self.dispatch = replica, replica.channel, replica.dispatch

    def train_micro_batch(self, mb: MicroBatch) -> None:
        if self.replica.probe is not None:
            self.replica.probe.remember(mb)
        if self.replica.trainer.trimodel.stage.routing_replay:  # rank 0 sees every sample (others get no groups)
            require_routes(s for g in mb.groups for s in g.samples)
        if not self.replica.trainer.shared_prompt:  # the K-copies layout needs the groups: only rank 0 has them
            mb = unshare_prompts(mb)
        if mb.replica == 0:
            self._call("train_micro_batch", mb, remote=False)
        elif self.dispatch is None:
            raise RuntimeError(f"micro-batch routed to replica {mb.replica} in a run without data parallelism")
        else:
            self.dispatch.send(mb.replica, ("train_micro_batch", (shipped(mb),)))

    def optimizer_step(self) -> None:
        self._call("optimizer_step")

    def sync_weights(self, version: int) -> int:
        """Sync every replica's policy to the engines as ``version``, then probe the engines at it."""
        self._call("sync_weights", version)
        probe = self.replica.probe.request(version) if self.replica.probe is not None else None
        if probe is not None:
            self._call("probe_engine", probe)
        return version

    def save_checkpoint(self, path: str | Path, state: RunState) -> Path:
        """Write a resumable checkpoint at ``path`` (collective over the world); see ``checkpoint``."""
        shutil.rmtree(staging_dir(path), ignore_errors=True)
        self._call("save", str(path))
        return finalize(staging_dir(path), state)

    def poll_stop(self) -> bool:
        return self._call("poll_stop")

    def pop_results(self) -> tuple[list[MiniBatchResult], dict[str, float]]:
        return self.replica.pop_results()

    def stop_followers(self, failure: BaseException | None = None) -> None:
        """Release the other ranks: ``stop``, or ``abort`` with the reason when ``failure`` is a
        ``WorldTimeout`` (each of them then raises it as well)."""
        message = ("abort", (str(failure),)) if isinstance(failure, WorldTimeout) else ("stop", ())
        self.channel.send(message)
        if self.dispatch is not None:
            self.dispatch.send_all(message)
            self.dispatch.flush()

    def _call(self, name: str, *args: Any, remote: bool = True) -> Any:
        if remote and self.dispatch is not None:
            self.dispatch.send_all((name, args))
        self.channel.send((name, args))
        return REPLICA_CALLS[name](self.replica, *args)


def follow(replica: Replica) -> None:
    """Every rank but 0: replay rank 0's calls until it says stop. The leader of another DP
    replica receives them from rank 0 (``data_parallel``) and relays them to its own ranks."""
    inbox = replica.dispatch if replica.channel.is_leader else None
    while True:
        name, args = _next_call(replica, inbox)
        if inbox is not None:
            replica.channel.send((name, args))
        if name == "stop":
            return
        if name == "abort":
            raise WorldTimeout(f"rank {dist.get_rank()}: rank 0 ended the run: {args[0]}")
        if name not in REPLICA_CALLS:
            raise RuntimeError(f"unknown replica call {name!r}")
        REPLICA_CALLS[name](replica, *args)


def _next_call(replica: Replica, inbox: DispatchChannel | None) -> tuple[str, Any]:
    """The next call from rank 0 (through this replica's leader); ``WorldTimeout`` naming
    ``parallel.timeout_s`` when the wait expires or rank 0 is gone."""
    try:
        return inbox.recv() if inbox is not None else replica.channel.recv()
    except RuntimeError as err:  # gloo: the group's timeout expired, or a peer closed its connection
        raise follower_timeout(dist.get_rank(), current_timeout_s(), "the next call from rank 0", err) from err


def shipped(mb: MicroBatch) -> MicroBatch:
    """``mb`` as it is sent to another replica: everything training reads, without ``groups``."""
    return dataclasses.replace(mb, groups=())
