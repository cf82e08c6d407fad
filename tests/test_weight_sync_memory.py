"""Device memory of the broadcast weight sync into a tensor-parallel (TP > 1) vLLM engine.

The engine's driver process receives every bucket over an NCCL / HCCL group, so the buckets
live on its first device, beside vLLM's own (85 % of it). It must stream them into the file
the TP workers reload (``VLLMBackend._reload_from_file``): two receive buffers on the device,
never the whole model. Measured here on the emulated device's counters, with the real
``broadcast.Receiver`` and ``VLLMBackend.load_tensors``, a loopback group in place of HCCL
and a fake ``vllm.LLM`` whose model lives on ``emulated:0`` and whose ``reload_weights``
copies the file's tensors into it (what each TP worker does with its shard).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.weight_sync import broadcast
from megatron_rl.weight_sync.buckets import TensorSpec, pack, plan_buckets
from megatron_rl.weight_sync.group import GroupAddress
from megatron_rl.weight_sync.snapshot import read_snapshot

MB = 1 << 20
BUCKET = 2 * MB


class _Done:
    def wait(self) -> bool:
        return True


class LoopbackGroup:
    """The sender's side of a sync group, in-process: each broadcast fills the receiver's
    buffer with the next bucket of ``tensors`` (host tensors: only the receiver touches the device)."""

    def __init__(self, tensors: list[torch.Tensor], bucket_bytes: int):
        self._tensors = tensors
        self._buckets = iter(plan_buckets([TensorSpec.of(str(i), t) for i, t in enumerate(tensors)], bucket_bytes))

    def broadcast(self, buffers, opts):
        (buffer,) = buffers
        pack(next(self._buckets), self._tensors, out=buffer)
        return _Done()


class FakeLLM:
    """``vllm.LLM`` as ``VLLMBackend`` calls it at TP > 1: ``reload_weights`` reads the HF
    safetensors in ``weights_path`` into the model (on the device), as every TP worker does."""

    def __init__(self, model: dict[str, torch.Tensor]):
        self.model, self.reloaded_from = model, []

    def collective_rpc(self, method: str, kwargs: dict):
        assert method == "reload_weights"
        self.reloaded_from.append(kwargs["weights_path"])
        loaded = set()
        for name, tensor in read_snapshot(kwargs["weights_path"]):
            self.model[name].copy_(tensor)  # host file -> device parameter
            loaded.add(name)
        assert loaded == set(self.model), sorted(set(self.model) - loaded)[:3]
        return [None, None]

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self) -> None:
        return None


def tp2_engine(device: torch.device, model: dict[str, torch.Tensor]):
    """A ``VLLMBackend`` at tensor-parallel size 2 on ``device`` around ``FakeLLM(model)``."""
    from megatron_rl.rollout.backends.vllm import VLLMBackend
    from megatron_rl.rollout.backends.vllm_api import VLLMEngine

    backend = VLLMBackend.__new__(VLLMBackend)  # no vLLM engine: its LLM is the fake
    backend._device_kind, backend._tp, backend._pending = device.type, 2, {}
    backend._engine = VLLMEngine(FakeLLM(model))
    return backend


def _weights(count: int, numel: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.weight", torch.randn(numel, generator=gen)) for i in range(count)]


def receive_peak(
    device: torch.device, named: list[tuple[str, torch.Tensor]], bucket_bytes: int, monkeypatch
) -> tuple[int, object]:
    """Bytes the broadcast receiver path allocates on ``device`` at its peak, above the model
    (already resident), for one sync of ``named`` into a TP-2 engine; and the engine."""
    model = {n: torch.zeros_like(t, device=device) for n, t in named}
    engine = tp2_engine(device, model)
    group = LoopbackGroup([t for _, t in named], bucket_bytes)
    monkeypatch.setattr(broadcast, "make_group", lambda address, rank: group)
    receiver = broadcast.Receiver()
    receiver.receive(broadcast.JoinGroups((GroupAddress("127.0.0.1", 1, 2, "hccl"),), 1), engine)
    base = torch.emulated.memory_allocated(device)
    torch.emulated.reset_peak_memory_stats(device)
    specs = tuple(TensorSpec.of(n, t) for n, t in named)
    receiver.receive(broadcast.ReceiveBuckets((specs,), bucket_bytes), engine)
    return torch.emulated.max_memory_allocated(device) - base, engine


def test_tp2_receiver_holds_two_buckets_not_the_model(device, monkeypatch):
    named = _weights(count=24, numel=MB // 4)  # 24 tensors of 1 MB: a 24 MB model, 12 buckets
    model_bytes = sum(t.nbytes for _, t in named)
    peak, engine = receive_peak(device, named, BUCKET, monkeypatch)
    print(
        f"\nreceiver peak above the model: {peak / MB:.1f} MB (model {model_bytes / MB:.0f} MB, "
        f"bucket {BUCKET / MB:.0f} MB)"
    )
    assert peak <= 2 * BUCKET, f"{peak / MB:.1f} MB on the device: more than 2 buckets of {BUCKET / MB:.0f} MB"
    for name, tensor in named:  # the engine's model now holds exactly the sent tensors
        assert torch.equal(engine._engine.llm.model[name].cpu(), tensor), name


def test_tp2_receiver_writes_one_file_and_removes_it(device, monkeypatch):
    named = _weights(count=5, numel=3000)
    _, engine = receive_peak(device, named, 4096, monkeypatch)  # tensors split across buckets
    (path,) = engine._engine.llm.reloaded_from
    assert not Path(path).exists()  # the engine's copy is gone once the TP workers reloaded
    for name, tensor in named:
        assert torch.equal(engine._engine.llm.model[name].cpu(), tensor), name


def test_tp2_engine_reloads_the_snapshot_directory_itself(device, tmp_path, monkeypatch):
    """``snapshot`` sync at TP > 1: the TP workers read the trainer's snapshot; the engine writes no copy."""
    from megatron_rl.weight_sync import TensorSource
    from megatron_rl.weight_sync.snapshot import Receiver, SnapshotUpdate

    named = _weights(count=3, numel=100)
    TensorSource(named).save(tmp_path / "v1")
    engine = tp2_engine(device, {n: torch.zeros_like(t, device=device) for n, t in named})
    written = []
    monkeypatch.setattr("megatron_rl.weight_sync.reload_files.write_shards", lambda *a, **k: written.append(a))
    Receiver().receive(SnapshotUpdate(str(tmp_path / "v1")), engine)
    assert engine._engine.llm.reloaded_from == [str(tmp_path / "v1")] and written == []
    for name, tensor in named:
        assert torch.equal(engine._engine.llm.model[name].cpu(), tensor), name


def test_write_shards_splits_by_size_and_reads_back_exactly(device, tmp_path):
    from megatron_rl.weight_sync.reload_files import write_shards

    named = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(_weights(count=7, numel=1000))]
    files = write_shards(((n, t.to(device)) for n, t in named), tmp_path, shard_bytes=5000)
    assert [f.name for f in files] == [f"model-{i:05d}.safetensors" for i in range(1, 5)]  # 2 tensors per file
    got = dict(read_snapshot(str(tmp_path)))
    assert list(got) == [n for n, _ in named]
    assert all(torch.equal(got[n], t) and got[n].dtype == t.dtype for n, t in named)
