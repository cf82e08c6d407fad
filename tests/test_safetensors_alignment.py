"""The streamed safetensors header keeps the data section 8-byte aligned, as safetensors' own
writer does: its header length N is padded with spaces to the next multiple of 8, so the data
starts at file offset 8 + N ≡ 0 (mod 8). Readers here (``safe_open``) accept a misaligned file
too, so only these tests see a wrong padding.

Reference: ``safetensors.torch.save_file`` (its header read back), for header lengths of every
residue mod 8 (one tensor name grows by a character at a time).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_rl.models.safetensors_stream import SafetensorsStream, TensorEntry

NAME_LENGTHS = range(1, 17)  # two full cycles of the header length mod 8


def _tensors(name_length: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes; one name ``name_length`` characters past its prefix."""
    g = torch.Generator().manual_seed(name_length)
    return {
        "b": torch.arange(3),
        "c": torch.randn(7, generator=g),
        "model.layers.0." + "x" * name_length: torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "d": torch.tensor([True, False, True]),
    }


def _header_of(path: Path) -> tuple[int, bytes]:
    """(N, the N header bytes) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n]


def _stream(path: Path, tensors: dict[str, torch.Tensor], order: list[str]) -> None:
    with SafetensorsStream(
        path, [TensorEntry(k, tensors[k].dtype, tuple(tensors[k].shape)) for k in order], {"format": "pt"}
    ) as out:
        for k in order:
            out.write(k, tensors[k])


def test_the_data_section_starts_8_byte_aligned_for_every_header_length(tmp_path):
    residues = set()
    for length in NAME_LENGTHS:
        tensors, path = _tensors(length), tmp_path / f"s{length}.safetensors"
        _stream(path, tensors, list(tensors))
        n, header = _header_of(path)
        json_bytes = header.rstrip(b" ")
        residues.add(len(json_bytes) % 8)
        assert (8 + n) % 8 == 0, f"name length {length}: data starts at file offset {8 + n}"
        assert len(header) - len(json_bytes) < 8, "more padding than alignment needs"
        assert json.loads(header)["__metadata__"] == {"format": "pt"}
        with safe_open(str(path), "pt") as f:
            assert sorted(f.keys()) == sorted(tensors)
        save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
        ref = load_file(str(tmp_path / "ref.safetensors"))
        got = load_file(str(path))
        assert all(got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]) for k in ref)
    assert residues == set(range(8))  # every padding from 0 to 7 spaces was exercised


def test_streamed_file_is_byte_identical_to_safetensors_own_writer(tmp_path):
    """Declared in the order safetensors' writer stores them (dtype size down, then name), the
    streamed file equals ``save_file``'s byte for byte, header padding included."""
    for length in NAME_LENGTHS:
        tensors = _tensors(length)
        ref_path, path = tmp_path / "ref.safetensors", tmp_path / "ours.safetensors"
        save_file(tensors, str(ref_path), metadata={"format": "pt"})
        n_ref, ref_header = _header_of(ref_path)
        assert n_ref % 8 == 0 and len(ref_header) - len(ref_header.rstrip(b" ")) < 8  # safetensors' own rule
        order = [k for k in json.loads(ref_header) if k != "__metadata__"]
        _stream(path, tensors, order)
        assert path.read_bytes() == ref_path.read_bytes(), f"name length {length}"
