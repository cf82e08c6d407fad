"""A run's weight directory (``trainer.snapshot_dir``): a run killed with SIGKILL leaves its
directory in /dev/shm (RAM until reboot); the next run on the host removes it, and only it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from megatron_rl.trainer.snapshot_dir import OWNER_FILE, PREFIX, make_snapshot_dir


def _leftover(base, name: str, owner: str | None):
    path = base / f"{PREFIX}{name}"
    (path / "v1").mkdir(parents=True)
    (path / "v1" / "model.safetensors").write_bytes(b"\0" * 1024)
    if owner is not None:
        (path / OWNER_FILE).write_text(owner)
    return path


def test_a_new_run_removes_the_directories_of_killed_runs_only(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # its pid is now free: the owner is gone
    host = socket.gethostname()
    dead = _leftover(tmp_path, "dead", f"{host} {child.pid}\n")
    live = _leftover(tmp_path, "live", f"{host} {os.getpid()}\n")
    other_host = _leftover(tmp_path, "other", f"not-{host} {child.pid}\n")
    unowned = _leftover(tmp_path, "unowned", None)
    unrelated = tmp_path / "something-else"
    unrelated.mkdir()
    with pytest.warns(UserWarning, match="left by killed runs"):
        new = make_snapshot_dir(str(tmp_path))
    assert not dead.exists()
    assert live.exists() and other_host.exists() and unowned.exists() and unrelated.exists()
    assert new.parent == tmp_path and new.name.startswith(PREFIX)
    assert (new / OWNER_FILE).read_text().split() == [host, str(os.getpid())]
