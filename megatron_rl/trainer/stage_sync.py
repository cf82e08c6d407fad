"""Weight sync from every pipeline stage: the trainer side of ``rollout.weight_sync`` =
``broadcast`` (``broadcast_weights``) and ``shared_memory`` (``shared_memory_weights``).

``shared_memory``: each stage's sender writes its stage into a ``/dev/shm`` file of its own
under the run's snapshot directory (``rollout.shared_weights``); the leader gathers the
layouts (stage order) and has the engines load them. No rank holds more than its stage.

Each PP stage gathers its own TP shards into HF-named full tensors (``export_hf_tensors``,
collective over the stage's TP group); the stage's TP rank 0 is its *sender*. The replica's
leader (TP 0 of stage 0) owns the engine pool and sends stage 0; at PP > 1 it drives the other
stages' senders as ``StagePeers`` through the replica's own channel (the model-parallel
group): every non-leader rank of the replica runs ``StageSender.serve`` until the leader says
``done``, so the object collectives line up. Each remote sender opens a broadcast group of its
own with the same engine workers and sends its buckets on it while the leader sends stage 0:
no rank ever holds more than its stage. Group state survives between syncs (``StageSender``
lives as long as the replica), as the leader's own group does.

The protocol on the channel, leader -> ranks: ``("join", (host, world, backend, timeout))``
then an all-gather of the senders' addresses; ``("send", (bucket_bytes,))`` then, once each
sender is done, an all-gather of their errors; ``("done", ())`` ends the sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rl.models import export_hf_tensors
from megatron_rl.rollout.broadcast import GroupAddress, make_group, open_listener, send_tensors
from megatron_rl.rollout.buckets import BufferRing, TensorSpec
from megatron_rl.rollout.shared_weights import SharedWeightsWriter


class ChannelPeers:
    """``weight_sync.StagePeers`` over the replica channel (leader side)."""

    def __init__(self, channel, sources: tuple[tuple[TensorSpec, ...], ...]):
        self.channel, self._sources = channel, sources

    @property
    def sources(self) -> tuple[tuple[TensorSpec, ...], ...]:
        return self._sources

    def join(self, host: str, world_size: int, backend: str, timeout_s: float) -> tuple[GroupAddress, ...]:
        self.channel.send(("join", (host, world_size, backend, timeout_s)))
        return tuple(a for _, a in sorted(e for e in _all_gather(self.channel, None) if e is not None))

    def start_send(self, bucket_bytes: int) -> None:
        self.channel.send(("send", (bucket_bytes,)))

    def finish_send(self) -> str | None:
        return next((e for e in _all_gather(self.channel, None) if e is not None), None)


class StageSender:
    """One non-leader rank's side of the protocol (module doc); keeps its group between syncs."""

    def __init__(self) -> None:
        self.group = None
        self.ring = BufferRing(2)  # send buffers, kept between syncs
        self.error: str | None = None  # why the group is unusable (reported at the next send)

    def serve(self, channel, stage: int, tensors: Sequence[torch.Tensor] | None) -> None:
        """Follow the leader's ops until ``done``; ``tensors`` is None on non-sender ranks."""
        while True:
            op, args = channel.recv()
            if op == "done":
                return
            if op == "join":
                self._join(channel, stage, tensors is not None, *args)
            elif op == "send":
                error = self._send(tensors, *args) if tensors is not None else None
                _all_gather(channel, error)
            else:
                raise RuntimeError(f"weight sync: unknown stage-sync op {op!r} from the leader")

    def _join(self, channel, stage: int, sender: bool, host: str, world: int, backend: str, timeout_s: float) -> None:
        if not sender:
            _all_gather(channel, None)
            return
        listener = open_listener(host)
        address = GroupAddress(host, listener.getsockname()[1], world, backend, timeout_s=timeout_s)
        _all_gather(channel, (stage, address))
        self.group, self.error = None, None
        try:
            self.group = make_group(address, 0, listener=listener)
        except RuntimeError as err:  # a worker died meanwhile: the leader repeats the join
            self.error = f"stage {stage}: joining the sync group failed: {err}"
        finally:
            listener.close()

    def _send(self, tensors: Sequence[torch.Tensor], bucket_bytes: int) -> str | None:
        if self.group is None:
            return self.error or "no sync group joined"
        try:
            send_tensors(self.group, tensors, bucket_bytes, self.ring)
        except RuntimeError as err:  # the leader sees a worker death and repeats the push
            self.group = None
            return f"sending failed: {err}"
        return None


def broadcast_weights(replica, version: int) -> int:
    """Push the policy to the engines by broadcast from every PP stage; returns the bytes sent."""
    from megatron.core import parallel_state as ps

    tensors = list(export_hf_tensors(replica.policy, replica.spec))  # collective over this stage's TP
    channel = replica.channel
    sender = ps.get_tensor_model_parallel_rank() == 0
    stage = ps.get_pipeline_model_parallel_rank()
    specs = tuple(TensorSpec.of(n, t) for n, t in tensors)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        if replica.engine is not None:
            replica.engine.update_weights_from_tensors(tensors, version)
        return sum(s.nbytes for s in specs)
    stages = sorted(e for e in _all_gather(channel, (stage, specs) if sender else None) if e is not None)
    if not channel.is_leader:
        replica.stage_sender.serve(channel, stage, [t for _, t in tensors] if sender else None)
    else:
        sources = tuple(s for st, s in stages if st != stage)
        try:
            if replica.engine is not None:
                replica.engine.update_weights_from_tensors(tensors, version, peers=ChannelPeers(channel, sources))
        finally:
            channel.send(("done", ()))
    return sum(s.nbytes for _, specs in stages for s in specs)


def shared_memory_weights(replica, version: int) -> int:
    """Write this stage's tensors to shared memory and have the engines load every stage's;
    returns the bytes synced."""
    from megatron.core import parallel_state as ps

    tensors = list(export_hf_tensors(replica.policy, replica.spec))  # collective over this stage's TP
    stage = ps.get_pipeline_model_parallel_rank()
    layout = None
    if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:  # one file per stage
        writer = replica.__dict__.setdefault("shared_writer", SharedWeightsWriter(
            Path(replica.snapshot_root) / f"weights-stage{stage}.bin"))  # rewritten in place every sync
        layout = writer.write(tensors)
    del tensors
    entries = _all_gather(replica.channel, (stage, layout)) if replica.channel.size > 1 else [(stage, layout)]
    layouts = tuple(lay for _, lay in sorted((e for e in entries if e[1] is not None), key=lambda e: e[0]))
    if replica.channel.is_leader and replica.engine is not None:
        replica.engine.update_weights_from_shared(layouts, version)
    return sum(lay.tensor_bytes for lay in layouts)


def _all_gather(channel, item) -> list:
    out: list = [None] * channel.size
    dist.all_gather_object(out, item, group=channel.group)
    return out
