"""Senders with the trainer's tensors on a device (the ``emulated`` accelerator: host tensors
in device ops raise, copies are counted): a gloo group's buckets are packed into host
buffers, NCCL / HCCL ones stay on the device; the shared-memory and snapshot writers copy
device tensors to host explicitly; every byte arrives unchanged."""

from __future__ import annotations

import torch

from megatron_rl.weight_sync import TensorSource
from megatron_rl.weight_sync.buckets import BufferRing, TensorSpec, Unpacker, pack, plan_buckets
from megatron_rl.weight_sync.group import buffer_device
from megatron_rl.weight_sync.shared_memory import SharedWeightsWriter, read_shared
from megatron_rl.weight_sync.snapshot import read_snapshot


def _tensors(device):
    gen = torch.Generator().manual_seed(0)
    host = [
        ("a", torch.randn(5, 3, generator=gen)),
        ("b", torch.randn(7, generator=gen).to(torch.bfloat16)),
        ("c", torch.randn(300, generator=gen)),
    ]
    return host, [(n, t.to(device)) for n, t in host]


def test_buffer_device_follows_the_group_backend(device):
    assert buffer_device("gloo", device) == torch.device("cpu")
    assert buffer_device("nccl", device) == device and buffer_device("hccl", device) == device


def test_gloo_buckets_of_device_tensors_are_host_buffers(device):
    host, on_device = _tensors(device)
    specs = [TensorSpec.of(n, t) for n, t in on_device]
    ring, unpacker, got = BufferRing(2), Unpacker(specs), {}
    for k, bucket in enumerate(plan_buckets(specs, 256)):  # small buckets: tensors split across them
        buffer = pack(bucket, [t for _, t in on_device], out=ring.get(k, bucket, buffer_device("gloo", device)))
        assert buffer.device == torch.device("cpu")
        got.update((n, t.clone()) for n, t in unpacker.feed(bucket, buffer))
    assert all(torch.equal(got[n], t) for n, t in host)


def test_shared_memory_and_snapshot_writers_copy_device_tensors_to_host(device, tmp_path):
    host, on_device = _tensors(device)
    layout = SharedWeightsWriter(tmp_path / "w.bin").write(on_device)
    assert all(torch.equal(t, dict(host)[n]) for n, t in read_shared(layout))
    TensorSource(on_device).save(tmp_path / "v1")
    assert all(torch.equal(t, dict(host)[n]) for n, t in read_snapshot(str(tmp_path / "v1")))
