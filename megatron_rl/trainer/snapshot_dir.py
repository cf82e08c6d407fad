"""The directory a run's weight snapshots and shared-memory weights live in: fresh per run, in
``/dev/shm`` when the machine has it.

A run killed with SIGKILL (the OOM killer, a scheduler's preemption, ``kill -9``) never removes
its directory, and in ``/dev/shm`` that is RAM held until reboot: one 0.5B-model run leaves about
1.5 GB. Each directory therefore names its owner (host and pid), and making a new one first
removes this host's directories whose owner is gone.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import warnings
from pathlib import Path

PREFIX = "megatron_rl-weights-"
OWNER_FILE = "owner"


def make_snapshot_dir(base: str | None) -> Path:
    """A new, empty-but-for-its-owner-file directory under ``base`` (None: the system's temp
    directory), after removing the directories of dead runs of this host there."""
    remove_dead_runs(base)
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=base))
    (path / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}\n")
    return path


def remove_dead_runs(base: str | None) -> list[Path]:
    """Remove every ``PREFIX*`` directory under ``base`` whose owner ran on this host and has
    exited; directories without an owner file, or of another host, are left alone."""
    host, removed = socket.gethostname(), []
    for path in sorted(Path(base or tempfile.gettempdir()).glob(PREFIX + "*")):
        owner = _owner(path)
        if owner is not None and owner[0] == host and not _alive(owner[1]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        warnings.warn(
            f"removed {len(removed)} weight directories left by killed runs: {', '.join(p.name for p in removed)}",
            stacklevel=2,
        )
    return removed


def _owner(path: Path) -> tuple[str, int] | None:
    try:
        host, pid = (path / OWNER_FILE).read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
