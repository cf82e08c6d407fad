"""The Python tool's sandbox against runaway code: an infinite loop, a fork bomb, a large
allocation, a connection to a socket the test listens on, a segfault, huge stdout and a
background process each end as a clean error result within the limits, never a hang or a crash
of the caller; the temporary directory is gone afterwards and the environment is minimal."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from megatron_rl.environments import sandbox
from megatron_rl.environments.sandbox import SandboxLimits, call_python, run_python, setup

FAST = SandboxLimits(cpu_s=1, wall_s=2.0, memory_mb=256, processes=8, output_bytes=512, file_mb=1)


def _run(code: str):
    start = time.perf_counter()
    result = run_python(code, FAST)
    assert time.perf_counter() - start < FAST.wall_s + 2.0  # the wall clock holds, start-up included
    return result


def test_plain_run_and_its_directory():
    result = _run("import os, sys\nprint(6 * 7)\nprint(os.getcwd())\nprint(sorted(os.environ))")
    assert result.ok and result.returncode == 0 and result.stderr == ""
    answer, cwd, env = result.stdout.splitlines()
    assert answer == "42" and not Path(cwd).exists()  # its own directory, deleted afterwards
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env and "'HOME'" in env
    assert call_python({"code": "print(2 ** 70)"}, FAST) == ("1180591620717411303424", True)
    assert call_python({"cod": "x"}, FAST)[1] is False


@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("while True:\n    pass", "limit"),  # CPU or wall clock, whichever comes first on a loaded machine
        ("import time\ntime.sleep(60)", "wall-clock limit"),
        ("import os\nwhile True:\n    os.fork()", "exit code"),  # RLIMIT_NPROC: fork fails, the bomb stops
        ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "limit"),
        ("x = bytearray(2 * 1024 ** 3)", "exit code 1"),  # MemoryError under RLIMIT_AS
        ("import ctypes\nctypes.string_at(0)", "SIGSEGV"),
        ("while True:\n    print('x' * 1000)", "output size limit"),
    ],
)
def test_runaway_code_ends_cleanly(code, words):
    result = _run(code)
    assert not result.ok and words in result.error
    assert f"[error: {result.error}]" in result.observation()
    if "bytearray" in code:
        assert "MemoryError" in result.stderr
    if code.endswith("os.fork()"):
        assert "BlockingIOError" in result.stderr  # fork refused at the process limit
    if "print('x'" in code:
        assert result.truncated and len(result.stdout) <= FAST.output_bytes


def test_no_network():
    if setup().isolation != "userns":
        pytest.skip("user namespaces unavailable here: the sandbox runs without network isolation (logged)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        result = _run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('in')")
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the host's loopback
    assert not result.ok and "in" not in result.stdout.split()
    assert "Error" in result.stderr  # ConnectionRefusedError / OSError: Network is unreachable


def _processes_with(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # ended meanwhile
            continue
        found += [text] if marker in text else []
    return found


def test_background_processes_die_with_the_run():
    marker = f"30.{time.time_ns()}"
    result = _run(f"import subprocess\nsubprocess.Popen(['sleep', '{marker}'])\nprint('started')")
    assert result.ok and result.stdout.strip() == "started"
    time.sleep(0.2)
    assert _processes_with(marker) == []


def test_weaker_mode_without_user_namespaces(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "UNSHARE", ("false",))  # as if `unshare --user --net` failed
    setup.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=sandbox.__name__):
            result = run_python("print('still limited')", FAST)
            run_python("print(1)", FAST)
        assert setup().isolation == "none" and result.ok and not result.network_isolated
        assert sum("WITHOUT network isolation" in r.getMessage() for r in caplog.records) == 1  # logged once
    finally:
        setup.cache_clear()


def test_a_returned_uid_is_taken_last():
    """A killed run's processes (a fork bomb's, dying in their PID namespace) can still count against
    its uid's RLIMIT_NPROC: the next run must get another uid ("unshare: fork failed" otherwise)."""
    from megatron_rl.environments.sandbox import _UidPool

    pool = _UidPool()
    first = pool.take()
    pool.give(first)
    assert pool.take() != first
