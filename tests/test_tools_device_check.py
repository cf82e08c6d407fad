"""``tools/device_check.py`` as a user runs it, here on the CPU: one JSON line with every section,
each check passing (Triton under the interpreter, tiny shapes, a 3-step RL run and its resume);
a failing check records its error without hiding the next one; the emulated device is either
checked or skipped as not available."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.devcheck import CHECKS

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "device_check.py"


def run_tool(*args: str, env_extra: dict | None = None, timeout: int = 300) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env_extra or {})
    proc = subprocess.run([sys.executable, str(TOOL), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.returncode, json.loads(lines[0]), proc.stderr


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device_check")
    interpret = {"TRITON_INTERPRET": "1"} if importlib.util.find_spec("triton") else {}
    code, report, stderr = run_tool("--device", "cpu", "--quick", "--skip", "rl_vllm", "--workdir", str(tmp / "work"),
                                    "--out", str(tmp / "out.json"), env_extra=interpret)
    assert code == 0, (json.dumps(report)[-4000:], stderr[-2000:])
    assert json.loads((tmp / "out.json").read_text()) == report
    return report


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.vllm
def test_every_section_is_there_and_passes(cpu_report):
    assert cpu_report["device"] == "cpu" and cpu_report["status"] == "pass"
    assert list(cpu_report["summary"]) == list(CHECKS) == list(cpu_report["checks"])
    assert cpu_report["summary"] == {"environment": "pass", "attention": "pass", "rl_hf": "pass", "resume": "pass",
                                     "rl_vllm": "skip"}
    assert cpu_report["checks"]["rl_vllm"]["reason"] == "--skip"
    assert set(cpu_report["thresholds"]) >= {"attention_rel_tolerance", "resume_rel_tolerance"}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.vllm
def test_environment_reports_versions_and_device(cpu_report):
    env = cpu_report["checks"]["environment"]
    assert set(env["versions"]) >= {"torch", "torch_npu", "vllm", "vllm_ascend", "apex", "transformer_engine",
                                    "triton", "megatron_core", "transformers"}
    assert env["versions"]["torch"].startswith("2.") and env["versions"]["megatron_core"].startswith("0.16")
    assert env["versions"]["torch_npu"] is None and env["versions"]["apex"] is None
    assert env["device"]["type"] == "cpu" and env["device"]["count"] == 1 and env["device"]["cpu_count"] >= 1


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.vllm
def test_attention_kernels_match_the_reference(cpu_report):
    fp32 = cpu_report["checks"]["attention"]["dtypes"]["float32"]
    ran = {name: k for name, k in fp32["kernels"].items() if k["status"] != "skip"}
    assert "split" in ran and ("triton" in ran or importlib.util.find_spec("triton") is None)
    for name, kernel in ran.items():
        assert kernel["status"] == "pass", (name, kernel)
        assert set(kernel["max_abs_err"]) == {"out", "dq", "dk", "dv"}
        assert all(0 <= e <= 1e-5 for e in kernel["max_abs_err"].values()), (name, kernel)
        assert kernel["tflops"] > 0 and kernel["speedup_vs_best_baseline"] > 0
    assert fp32["kernels"]["flex"]["status"] == fp32["kernels"]["npu"]["status"] == "skip"
    assert fp32["baselines"]["sdpa_per_sample"]["status"] == "pass"


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.vllm
def test_rl_run_trains_and_resume_reproduces_it(cpu_report):
    rl, resume = cpu_report["checks"]["rl_hf"], cpu_report["checks"]["resume"]
    assert len(rl["steps"]) == 3 and rl["max_weight_change"] > 1e-4
    assert all(s["logprob_gap_mean"] <= 1e-3 and s["step_s"] > 0 for s in rl["steps"])
    assert len(resume["steps"]) == 1 and resume["step3_change"] > 0
    assert resume["rel_diff"] <= resume["tolerance"]


@pytest.mark.slow
def test_a_failing_check_does_not_hide_the_next(tmp_path):
    """No CUDA here: environment fails on its threshold, attention on setup_platform's error."""
    code, report, _ = run_tool("--device", "cuda", "--skip", "rl_hf,resume,rl_vllm", "--workdir", str(tmp_path))
    assert code == 1 and report["status"] == "fail"
    assert report["summary"]["environment"] == report["summary"]["attention"] == "fail"
    assert report["checks"]["environment"]["reasons"] == ["torch sees no cuda device"]
    error = report["checks"]["attention"]["error"]
    assert error["type"] == "RuntimeError" and "CUDA" in error["message"] and "device.py" in error["last_frame"]


@pytest.mark.slow
def test_emulated_device_is_checked_or_reported_not_available(tmp_path):
    code, report, _ = run_tool("--device", "emulated", "--quick", "--skip", "rl_hf,resume,rl_vllm",
                               "--workdir", str(tmp_path))
    env = report["checks"]["environment"]
    if env["status"] == "skip":
        assert code == 0 and env["reason"].startswith("not available")
        assert report["checks"]["attention"] == {"status": "skip", "reason": env["reason"]}
    else:
        assert code == 0 and report["summary"]["attention"] == "pass", json.dumps(report)[-3000:]


def test_unknown_check_name_is_refused():
    proc = subprocess.run([sys.executable, str(TOOL), "--device", "cpu", "--skip", "rl_hf,nope"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "unknown check(s) ['nope']" in proc.stderr
