"""Weight sync: putting policy version v into every rollout engine, in one place.

One concern, two sides, one package that both the trainer and the rollout package import
(and that imports neither): the *sender* runs on the trainer ranks, the *receiver* inside
each engine worker, and the engine's one entry point ``load_weights(update, version)``
carries a typed ``WeightUpdate`` between them (``base``). One module per transport, named
as in the schema's ``WeightSync`` Literal and found by that name (``build_sender`` /
``build_receiver``), each holding its ``Sender``, ``Receiver`` and update message:

- ``snapshot``: a HF safetensors directory every rank writes its share of; workers read it.
- ``shared_memory``: one /dev/shm file per pipeline stage, mapped by the workers (one machine).
- ``broadcast``: flat buckets over a gloo / NCCL / HCCL group per pipeline stage (``group``,
  ``buckets``); the leader drives the other stages' senders itself (``Sender.follow``).

Adding a transport (device IPC, a remote-node broadcast, deltas): a module here with
``Sender`` / ``Receiver``, its name in ``config.schema.WeightSync``, and a test.

    sender = build_sender(cfg.rollout.weight_sync, SenderSetup(source=..., engine=pool, ...))
    stats = sender.sync(version)        # on every rank of the replica, in the same order
"""

from megatron_rl.weight_sync.base import (
    TRANSPORTS,
    SenderSetup,
    StagePlace,
    SyncStats,
    TensorSource,
    UpdateTensors,
    WeightReceiver,
    WeightSender,
    WeightSource,
    WeightUpdate,
    WorkerLoad,
    build_receiver,
    build_sender,
    is_partial,
)

__all__ = [
    "TRANSPORTS",
    "SenderSetup",
    "StagePlace",
    "SyncStats",
    "TensorSource",
    "UpdateTensors",
    "WeightReceiver",
    "WeightSender",
    "WeightSource",
    "WeightUpdate",
    "WorkerLoad",
    "build_receiver",
    "build_sender",
    "is_partial",
]
