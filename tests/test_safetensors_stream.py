"""The streaming safetensors writer: files read back by safetensors itself, misuse refused.

Reference: ``safetensors.safe_open`` / ``load_file`` reading what ``SafetensorsStream`` wrote
(every dtype the checkpoints use, odd header lengths, a 0-d and an empty tensor), and the
same bytes ``safetensors.torch.save_file`` gives for the tensors, read back.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_rl.models.safetensors_stream import SafetensorsStream, TensorEntry


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.bf16": torch.randn(3, 9, generator=g).to(torch.bfloat16),
        "c.half": torch.randn(11, generator=g).to(torch.float16),
        "d.ids": torch.arange(13, dtype=torch.int64),
        "e.scalar": torch.tensor(2.5),
        "f.empty": torch.zeros(0, 4),
        "g.strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
    }


def _entries(tensors):
    return [TensorEntry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]


def test_streamed_file_reads_back_exactly(tmp_path):
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    with SafetensorsStream(path, _entries(tensors), {"format": "pt"}) as out:
        for name, tensor in tensors.items():
            out.write(name, tensor)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor), name
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "ref.safetensors"))
    ref = load_file(str(tmp_path / "ref.safetensors"))
    assert all(torch.equal(ref[n], t) for n, t in load_file(str(path)).items())


def test_misuse_is_refused_and_leaves_no_partial_file(tmp_path):
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="'b.bf16'"):  # out of order: the header declares a.weight first
        with SafetensorsStream(path, _entries(tensors)) as out:
            out.write("b.bf16", tensors["b.bf16"])
    assert not path.exists()
    out = SafetensorsStream(path, _entries(tensors))
    with pytest.raises(ValueError, match="declares 'a.weight'"):
        out.write("a.weight", tensors["a.weight"].double())  # wrong dtype
    with pytest.raises(ValueError, match="closed before tensor 'a.weight'"):
        out.close()
    assert not path.exists()
    with pytest.raises(ValueError, match="appears twice"):
        SafetensorsStream(path, _entries(tensors) * 2)
