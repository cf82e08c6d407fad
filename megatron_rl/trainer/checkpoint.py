"""Training checkpoints: policy weights (HF safetensors), optimizer state, and the run state
(step, group-size controller, prompt stream, config) — enough to resume exactly.

Layout of ``<save_dir>/step_N``::

    model/              HF checkpoint of the policy (loadable by transformers, vLLM, the trainer);
                        not written with LoRA, whose base is not rewritten at every save:
    adapter/            (LoRA) the adapters in PEFT's format (``lora.checkpoint``):
                        adapter_config.json + adapter_model.safetensors, what
                        ``PeftModel.from_pretrained(base, adapter/)`` loads
    base_model.json     (LoRA) {"path", "fingerprint"} of the base the adapters were trained on
    merged/             (LoRA, ``lora.save_merged``) HF checkpoint of W + scale * B A
    optimizer/          Adam state per HF-named parameter (``optimizer_state``; with LoRA per
                        PEFT-named adapter tensor): the trainer writes this, and any TP x PP x
                        DP layout resumes it
    optimizer/rank_R.pt (older checkpoints, ``save_optimizer``) one rank's optimizer state
                        dict: plain containers of tensors and scalars; same layout only
    trainer_state.json  {"step", "controller", "prompt_stream", "config"}
    manifest.json       {"format", "files": {relative path: {"size", "sha256"}}}, written last

Contract:
- Written into ``step_N.tmp`` and renamed when complete: an interrupted save leaves no
  directory that looks like a checkpoint. Every file is fsynced before the manifest is
  written, the manifest before the rename.
- Safe loading only: the optimizer state is checked at save time to hold nothing but dicts,
  lists, tuples, strings, numbers, booleans, None and tensors (``CheckpointError`` naming the
  key otherwise), so it loads with ``torch.load(weights_only=True)``, which runs no pickled
  code. Weights are safetensors.
- A LoRA checkpoint resumes on the base named by the resuming run's ``model.hf_path`` (a moved
  base: point ``model.hf_path`` at its new place); ``base_model.json``'s fingerprint (config.json
  and the size, first and last MiB of each safetensors file: a cheap identity check, not a
  hash of the weights) must match it, else ``CheckpointError`` naming ``model.hf_path``.
- ``load_run_state`` verifies the manifest first: a missing, truncated or corrupted file
  raises ``CheckpointError`` (a ``ValueError``) naming the file, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STATE_FILE = "trainer_state.json"
MODEL_DIR, ADAPTER_DIR, MERGED_DIR, BASE_FILE = "model", "adapter", "merged", "base_model.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)
_BLOCK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded; the message names the file or key."""


@dataclass(frozen=True, kw_only=True)
class RunState:
    """What the leader saves besides weights and optimizer state."""

    step: int  # number of completed steps
    controller: dict[str, Any]
    prompt_stream: dict[str, Any] | None
    config: dict[str, Any]


def staging_dir(path: str | Path) -> Path:
    """Where a checkpoint for ``path`` is written before it is renamed into place."""
    path = Path(path)
    return path.with_name(path.name + ".tmp")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_optimizer(optimizer, staging: Path) -> None:
    """This rank's optimizer state into ``staging/optimizer/rank_R.pt`` (plain; see module doc)."""
    state = optimizer.state_dict()
    check_plain(state, "optimizer.state_dict()")
    (staging / "optimizer").mkdir(parents=True, exist_ok=True)
    torch.save(state, staging / "optimizer" / f"rank_{_rank()}.pt")


def check_plain(tree: Any, where: str) -> None:
    """Raise ``CheckpointError`` naming the first value ``torch.load(weights_only=True)`` would
    refuse (anything but containers, strings, numbers, booleans, None and tensors)."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if not isinstance(key, str | int):
                raise CheckpointError(f"{where}: key {key!r} of type {type(key).__name__} cannot be saved safely")
            check_plain(value, f"{where}[{key!r}]")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            check_plain(value, f"{where}[{i}]")
    elif not isinstance(tree, _PLAIN):
        raise CheckpointError(
            f"{where}: a {type(tree).__name__} cannot be saved for safe loading "
            "(weights_only); convert it to tensors or plain values"
        )


def finalize(staging: Path, state: RunState) -> Path:
    """Leader, once every rank's files are written: the run state, then the manifest, then
    the rename into place."""
    (staging / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1, default=str))
    write_manifest(staging)
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    return final


def write_manifest(directory: Path) -> None:
    """Size and sha256 of every file under ``directory`` (fsynced) into ``manifest.json``."""
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE):
        files[file.relative_to(directory).as_posix()] = {"size": file.stat().st_size, "sha256": _sha256(file, True)}
    tmp = directory / (MANIFEST_FILE + ".tmp")
    with tmp.open("w") as f:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_FILE)


def verify_checkpoint(path: str | Path) -> None:
    """Check every file the manifest lists: present, same size, same sha256."""
    path = Path(path)
    manifest = _read_manifest(path)
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r}: file {name} is missing")
        size = file.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: file {name} is truncated or altered: "
                f"{size} bytes, the manifest says {entry['size']}"
            )
        if _sha256(file) != entry["sha256"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: file {name} is corrupted (sha256 differs from the manifest)"
            )


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r}: no {MANIFEST_FILE} (an incomplete save, or written by an "
            "older version: refused, its integrity cannot be checked)"
        )
    bad = CheckpointError(f"checkpoint {str(path)!r}: {MANIFEST_FILE} is unreadable or corrupted")
    try:
        manifest = json.loads(file.read_text())
    except ValueError as err:  # JSON or UTF-8 decoding
        raise bad from err
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(files, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not all(isinstance(e, dict) and {"size", "sha256"} <= set(e) for e in files.values())
    ):
        raise bad
    return manifest


def load_run_state(path: str | Path) -> RunState:
    """Verify the checkpoint (manifest), then read its ``trainer_state.json``;
    ``CheckpointError`` naming the path or file if it is not a complete, intact checkpoint."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"trainer.resume_from={str(path)!r}: no {STATE_FILE} there (not a complete checkpoint)")
    verify_checkpoint(path)
    try:
        return RunState(**json.loads(file.read_text()))
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"checkpoint {str(path)!r}: {STATE_FILE} is not a run state ({err})") from err


def load_optimizer(optimizer, path: str | Path) -> None:
    """Restore this rank's optimizer state from a checkpoint (``weights_only`` loading)."""
    file = Path(path) / "optimizer" / f"rank_{_rank()}.pt"
    if not file.is_file():
        raise CheckpointError(
            f"trainer.resume_from={str(path)!r}: missing {file.name} for rank {_rank()} "
            "(was it saved with a different world size?)"
        )
    try:
        state = torch.load(file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as err:  # refused or unreadable
        raise CheckpointError(f"checkpoint file {file} cannot be loaded safely: {err}") from err
    optimizer.load_state_dict(state)


def latest_checkpoint(save_dir: str | Path) -> Path | None:
    """The complete checkpoint (``step_N`` whose manifest verifies) with the largest N in
    ``save_dir``, or None; ``step_N.tmp`` and damaged ones are skipped (a save the kill interrupted)."""
    steps = sorted(
        ((int(p.name[5:]), p) for p in Path(save_dir).glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
        reverse=True,
    )
    for _, path in steps:
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


def resolve_resume(cfg: Any) -> Any:
    """``cfg`` with ``trainer.resume_from: auto`` replaced by ``latest_checkpoint(save_dir)`` (None:
    a fresh start); any other value is returned as it is. Every rank reads the same directory."""
    t = cfg.trainer
    if t.resume_from != "auto":
        return cfg
    found = latest_checkpoint(t.save_dir) if t.save_dir else None
    if _rank() == 0:
        print(
            f"megatron_rl: trainer.resume_from=auto -> {found or 'no complete checkpoint: a fresh start'}", flush=True
        )
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, resume_from=str(found) if found else None))


def save_policy(optimizer, policy, spec, staging: Path, *, source_dir: str | Path, save_merged: bool) -> None:
    """This rank's share of the policy's weights and optimizer state in ``staging`` (module doc):
    ``model/`` for a full model; ``adapter/`` + ``base_model.json`` (+ ``merged/`` when
    ``save_merged``) for a LoRA policy, whose base is ``source_dir``. Collective over the world."""
    from megatron_rl.lora.checkpoint import has_adapters, save_merged_checkpoint, save_peft_adapter
    from megatron_rl.models import save_hf_checkpoint
    from megatron_rl.trainer.optimizer_state import save_optimizer_state

    if has_adapters(policy):
        save_peft_adapter(policy, staging / ADAPTER_DIR, base_path=source_dir)
        if save_merged:
            save_merged_checkpoint(policy, spec, staging / MERGED_DIR, source_dir=source_dir)
        if _rank() == 0:
            base = {"path": str(source_dir), "fingerprint": base_fingerprint(source_dir)}
            (staging / BASE_FILE).write_text(json.dumps(base, indent=1))
    else:
        save_hf_checkpoint(policy, spec, staging / MODEL_DIR, source_dir=source_dir)
    save_optimizer_state(optimizer, policy, spec, staging / "optimizer")


def base_fingerprint(path: str | Path) -> str:
    """A cheap identity of the HF checkpoint at ``path``: sha256 of its config.json and of each
    safetensors file's name, size, first and last MiB (a different model or fine-tune differs)."""
    path, digest = Path(path), hashlib.sha256()
    digest.update((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            digest.update(f.read(_BLOCK))
            f.seek(max(size - _BLOCK, 0))
            digest.update(f.read(_BLOCK))
    return digest.hexdigest()


def resume_policy_path(checkpoint: str | Path, *, lora: bool, base_path: str | Path) -> str:
    """Where the resumed policy's weights load from: ``checkpoint/model`` for a full model; the
    base ``base_path`` (``model.hf_path``) for LoRA, checked against ``base_model.json``.
    ``CheckpointError`` naming the key when the checkpoint is of the other kind or another base."""
    checkpoint = Path(checkpoint)
    if not lora:
        if not (checkpoint / MODEL_DIR).is_dir() and (checkpoint / ADAPTER_DIR).is_dir():
            raise CheckpointError(
                f"trainer.resume_from={str(checkpoint)!r} holds LoRA adapters: resume it with its lora section "
                f"(lora.rank > 0), or start a full fine-tune from its {MERGED_DIR}/ as model.hf_path"
            )
        return str(checkpoint / MODEL_DIR)
    if not (checkpoint / ADAPTER_DIR).is_dir():
        raise CheckpointError(
            f"trainer.resume_from={str(checkpoint)!r} has no {ADAPTER_DIR}/ (a full fine-tune checkpoint), but "
            "lora.rank > 0: resume it with lora.rank 0, or start LoRA from its model/ as model.hf_path"
        )
    saved = json.loads((checkpoint / BASE_FILE).read_text())
    if saved["fingerprint"] != base_fingerprint(base_path):
        raise CheckpointError(
            f"model.hf_path={str(base_path)!r} is not the base the adapters of {str(checkpoint)!r} were trained on "
            f"({saved['path']!r}; fingerprints differ): point model.hf_path at that base"
        )
    return str(base_path)


def load_policy_state(optimizer, policy, spec, checkpoint: str | Path) -> None:
    """Restore the policy's adapters (LoRA: ``adapter/``, PEFT's format) and the optimizer state
    of ``checkpoint`` into this rank's shards: per HF / PEFT name (any layout), or an older
    checkpoint's per-rank files (the same layout only)."""
    from megatron_rl.lora.checkpoint import has_adapters, load_peft_adapter
    from megatron_rl.trainer.optimizer_state import is_resharding_checkpoint, load_optimizer_state

    checkpoint = Path(checkpoint)
    if has_adapters(policy):
        load_peft_adapter(policy, checkpoint / ADAPTER_DIR)
    if is_resharding_checkpoint(checkpoint / "optimizer"):
        load_optimizer_state(optimizer, policy, spec, checkpoint / "optimizer")
    else:
        load_optimizer(optimizer, checkpoint)


def _sha256(file: Path, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
