"""Training checkpoints: policy weights (HF safetensors), optimizer state per rank, and the
run state (step, group-size controller, prompt stream, config) — enough to resume exactly.

Layout of ``<save_dir>/step_N``::

    model/            HF checkpoint of the policy (loadable by transformers, vLLM, the trainer)
    optimizer/rank_R.pt
    trainer_state.json  {"step", "controller", "prompt_stream", "config"}

Written into ``step_N.tmp`` and renamed when complete: an interrupted save leaves no
directory that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

STATE_FILE = "trainer_state.json"


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


def save_optimizer(optimizer, staging: Path) -> None:
    """This rank's optimizer state into ``staging/optimizer/rank_R.pt``."""
    (staging / "optimizer").mkdir(parents=True, exist_ok=True)
    torch.save(optimizer.state_dict(), staging / "optimizer" / f"rank_{dist.get_rank()}.pt")


def finalize(staging: Path, state: RunState) -> Path:
    """Leader: write the run state and rename the staging directory into place."""
    (staging / STATE_FILE).write_text(json.dumps(state.__dict__, indent=1, default=str))
    final = staging.with_name(staging.name.removesuffix(".tmp"))
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def load_run_state(path: str | Path) -> RunState:
    """Read ``trainer_state.json`` of a checkpoint; ``ValueError`` naming the path if it is not one."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise ValueError(f"trainer.resume_from={str(path)!r}: no {STATE_FILE} there (not a complete checkpoint)")
    return RunState(**json.loads(file.read_text()))


def load_optimizer(optimizer, path: str | Path) -> None:
    """Restore this rank's optimizer state from a checkpoint."""
    file = Path(path) / "optimizer" / f"rank_{dist.get_rank()}.pt"
    if not file.is_file():
        raise ValueError(f"trainer.resume_from={str(path)!r}: missing {file.name} for rank {dist.get_rank()} "
                         "(was it saved with a different world size?)")
    optimizer.load_state_dict(torch.load(file, weights_only=False))
