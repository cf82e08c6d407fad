"""The dead-run sweep of ``trainer.snapshot_dir`` asks ``os.kill(pid, 0)`` whether a directory's
owner lives: ``ProcessLookupError`` means it is gone (its directory is removed),
``PermissionError`` means it lives under another user (its directory, possibly the weights a
running job is reading, stays). The owner pid's answer is patched in; no process is started.
"""

from __future__ import annotations

import errno
import os
import socket
import warnings

import pytest

from megatron_rl.trainer import snapshot_dir
from megatron_rl.trainer.snapshot_dir import OWNER_FILE, PREFIX, remove_dead_runs

OWNER_PID = 4_194_304 + 17  # above Linux's largest pid_max: the real os.kill is never asked about it


def _owned_dir(base, pid: int):
    path = base / f"{PREFIX}run"
    (path / "v1").mkdir(parents=True)
    (path / "v1" / "model.safetensors").write_bytes(b"\0" * 1024)
    (path / OWNER_FILE).write_text(f"{socket.gethostname()} {pid}\n")
    return path


def _kill_raising(monkeypatch, error: type[OSError]) -> list[tuple[int, int]]:
    """Patch ``os.kill`` so that probing ``OWNER_PID`` raises ``error``; the calls made to it."""
    real, calls = os.kill, []

    def fake_kill(pid: int, sig: int) -> None:
        if pid != OWNER_PID:
            return real(pid, sig)
        calls.append((pid, sig))
        code = errno.EPERM if error is PermissionError else errno.ESRCH  # what the kernel answers
        raise error(code, os.strerror(code))

    monkeypatch.setattr(snapshot_dir.os, "kill", fake_kill)
    return calls


def test_another_users_live_process_keeps_its_directory(tmp_path, monkeypatch):
    path = _owned_dir(tmp_path, OWNER_PID)
    calls = _kill_raising(monkeypatch, PermissionError)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "removed ... left by killed runs" warning either
        assert remove_dead_runs(str(tmp_path)) == []
    assert calls == [(OWNER_PID, 0)]  # the owner was asked about, with signal 0 (a probe, no signal sent)
    assert (path / "v1" / "model.safetensors").exists() and (path / OWNER_FILE).exists()


def test_a_process_that_is_gone_loses_its_directory(tmp_path, monkeypatch):
    path = _owned_dir(tmp_path, OWNER_PID)
    calls = _kill_raising(monkeypatch, ProcessLookupError)
    with pytest.warns(UserWarning, match="left by killed runs"):
        assert remove_dead_runs(str(tmp_path)) == [path]
    assert calls == [(OWNER_PID, 0)] and not path.exists()
