"""Runs the Triton kernel checks (``attention_triton_interpreted.py``, single rank, and
``attention_triton_cp_interpreted.py``, context parallel) in a subprocess with
``TRITON_INTERPRET=1``, so the interpreter setting never leaks into this process."""

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.kernels]

pytest.importorskip("triton")

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "checks",
    [
        "attention_triton_interpreted.py",
        pytest.param("attention_triton_cp_interpreted.py", marks=pytest.mark.multiproc),  # gloo ranks
    ],
)
def test_triton_kernel_under_interpreter(checks: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/{checks}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
