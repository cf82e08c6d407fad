"""Flat-bucket packing for weight sync (``weight_sync.buckets``): every tensor comes back bit-exact
across dtypes, bucket boundaries and tensors larger than a bucket, in-process and through a
real gloo broadcast group; the shared-memory files (``weight_sync.shared_memory``) likewise, and a
version's file survives the next write."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from megatron_rl.weight_sync.buckets import BufferRing, TensorSpec, Unpacker, pack, plan_buckets
from megatron_rl.weight_sync.group import GroupAddress, make_group, open_listener, receive_tensors, send_tensors
from megatron_rl.weight_sync.shared_memory import SharedWeightsWriter, read_shared


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.f32", torch.randn(7, 5, generator=g)),
        ("b.bf16", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("c.f32.big", torch.randn(40, 3, generator=g)),  # 480 B: larger than the 64 B buckets below
        ("d.i64", torch.arange(11)),
        ("e.empty", torch.empty(0, 4)),
        ("f.f32.t", torch.randn(6, 4, generator=g).t()),  # not contiguous
        ("g.bf16", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
    ]


def _round_trip(named, bucket_bytes: int) -> dict[str, torch.Tensor]:
    specs = [TensorSpec.of(n, t) for n, t in named]
    unpacker, out = Unpacker(specs), {}
    for bucket in plan_buckets(specs, bucket_bytes):
        buffer = pack(bucket, [t for _, t in named]).clone()  # what a receiver gets: a copy
        assert buffer.dtype == bucket.torch_dtype and buffer.numel() == bucket.numel
        assert bucket.nbytes <= max(bucket_bytes, bucket.torch_dtype.itemsize)
        out.update(unpacker.feed(bucket, buffer))
    return out


@pytest.mark.parametrize("bucket_bytes", [1, 64, 100, 1 << 20])
def test_round_trip_is_exact_across_dtypes_and_boundaries(bucket_bytes):
    named = _tensors()
    out = _round_trip(named, bucket_bytes)
    assert sorted(out) == sorted(n for n, _ in named)
    for name, t in named:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_buckets_hold_one_dtype_and_split_large_tensors():
    named = _tensors()
    specs = [TensorSpec.of(n, t) for n, t in named]
    buckets = plan_buckets(specs, 64)
    for b in buckets:
        assert all(specs[p.index].dtype == b.dtype for p in b.pieces)
        assert b.numel == sum(p.numel for p in b.pieces) <= 64 // b.torch_dtype.itemsize
    big = [b for b in buckets if any(specs[p.index].name == "c.f32.big" for p in b.pieces)]
    assert len(big) >= 480 // 64  # the big tensor spans several buckets
    assert len(plan_buckets(specs, 1 << 20)) == 3  # one bucket per dtype when everything fits


def test_a_bucket_of_one_whole_tensor_is_that_tensor():
    t = torch.randn(16)
    (bucket,) = plan_buckets([TensorSpec.of("w", t)], 64)
    assert pack(bucket, [t]).data_ptr() == t.data_ptr()


def test_bad_bucket_size_names_the_key():
    with pytest.raises(ValueError, match="rollout.sync_bucket_mb"):
        plan_buckets([TensorSpec.of("w", torch.ones(2))], 0)


@pytest.mark.parametrize("reuse", [False, True])
def test_gloo_broadcast_in_buckets_round_trip(reuse):
    named = _tensors()
    specs = [TensorSpec.of(n, t) for n, t in named]
    listener = open_listener("127.0.0.1")
    address = GroupAddress("127.0.0.1", listener.getsockname()[1], 2, "gloo", timeout_s=60)
    received: dict[str, torch.Tensor] = {}

    def receiver() -> None:
        group = make_group(address, 1)
        ring = BufferRing(2) if reuse else None  # each tensor is copied before the next is taken
        received.update((n, t.clone()) for n, t in receive_tensors(group, specs, 100, torch.device("cpu"), ring))

    thread = threading.Thread(target=receiver)
    thread.start()
    group = make_group(address, 0, listener=listener)
    sent = send_tensors(group, [t for _, t in named], 100, BufferRing(2) if reuse else None)
    thread.join(60)
    assert sent == sum(s.nbytes for s in specs)
    for name, t in named:
        assert torch.equal(received[name], t), name


def test_shared_memory_round_trip_keeps_the_previous_version(tmp_path):
    named = [(n, t) for n, t in _tensors() if t.is_contiguous()]
    writer = SharedWeightsWriter(tmp_path / "weights.bin")
    first = writer.write(named)
    second = writer.write([(n, t + 1) for n, t in named])
    assert first.path != second.path and first.tensor_bytes == sum(t.nbytes for _, t in named)
    got_first, got_second = dict(read_shared(first)), dict(read_shared(second))
    for name, t in named:
        assert torch.equal(got_first[name], t), name  # v1 intact after v2 was written
        assert torch.equal(got_second[name], t + 1), name
    writer.write(named)  # v3 reuses v1's file (and the reader's cached mapping sees it)
    assert all(torch.equal(v, t) for (_, t), v in zip(named, dict(read_shared(first)).values(), strict=True))


def test_missing_shared_file_names_the_key(tmp_path):
    layout = SharedWeightsWriter(tmp_path / "w.bin").write([("w", torch.ones(2))])
    Path(layout.path).unlink()
    with pytest.raises(FileNotFoundError, match="rollout.weight_sync=shared_memory"):
        list(read_shared(layout))
