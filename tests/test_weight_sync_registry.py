"""The weight-sync registry: every ``rollout.weight_sync`` name of the schema is a module of
``megatron_rl.weight_sync`` with a ``Sender`` and a ``Receiver``, built by name; an unknown
name is refused naming the key and the choices."""

from __future__ import annotations

from typing import get_args

import pytest

from megatron_rl.config import schema
from megatron_rl.weight_sync import TRANSPORTS, SenderSetup, TensorSource, build_receiver, build_sender


def test_every_schema_name_is_a_transport_with_both_sides(tmp_path):
    assert TRANSPORTS == get_args(schema.WeightSync)
    for name in TRANSPORTS:
        sender = build_sender(name, SenderSetup(source=TensorSource([]), scratch=tmp_path))
        assert callable(sender.sync) and callable(build_receiver(name).receive)


def test_unknown_transport_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"rollout.weight_sync='carrier_pigeon'.*snapshot"):
        build_sender("carrier_pigeon", SenderSetup(source=TensorSource([])))


def test_senders_without_an_engine_move_nothing_but_report_bytes(tmp_path):
    """A rank without the engine (PP = 1, not the leader's replica) still exports and counts."""
    import torch

    tensors = [("a", torch.ones(4)), ("b", torch.zeros(2, 3, dtype=torch.bfloat16))]
    nbytes = {
        name: build_sender(name, SenderSetup(source=TensorSource(tensors), scratch=tmp_path)).sync(1).nbytes
        for name in TRANSPORTS
    }
    assert nbytes["broadcast"] == nbytes["shared_memory"] == 4 * 4 + 6 * 2
    assert nbytes["snapshot"] > 28  # the safetensors file: tensors + header
