"""``make test``'s worker split: under ``-n 2 --dist loadgroup`` every process-starting test runs
on one xdist worker (the ``processes`` group of ``conftest.py``), the others anywhere.

Run on a throw-away suite with this repository's ``conftest.py`` and ``pytest.ini``: its
``multiproc`` tests must all report ``@processes`` from a single worker. Both ways it broke are
covered: ``conftest``'s hook running after xdist's (the mark came too late to reach the node id)
and pytest 9.2's structured node ids (pytest-dev/pytest-xdist#1386, refused up front)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SUITE = '''
import pytest

@pytest.mark.multiproc
@pytest.mark.parametrize("i", range(4))
def test_process_world(i):
    pass

@pytest.mark.parametrize("i", range(4))
def test_single_process(i):
    pass

WorkerPool = None  # a process starter's name: conftest marks the test that uses it multiproc


def test_starts_a_pool():
    assert WorkerPool is None
'''


def test_process_starting_tests_share_one_worker(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "tests").mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    shutil.copy(REPO / "pytest.ini", tmp_path / "pytest.ini")
    (tmp_path / "tests" / "test_split.py").write_text(SUITE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "tests"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ran = re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED tests/test_split.py::(\S+)", proc.stdout)
    assert len(ran) == 9, proc.stdout[-3000:]
    grouped = {(worker, name) for worker, name in ran if name.endswith("@processes")}
    assert {re.split(r"[[@]", name)[0] for _, name in grouped} == {"test_process_world", "test_starts_a_pool"}
    assert len(grouped) == 5 and len({worker for worker, _ in grouped}) == 1, sorted(ran)
