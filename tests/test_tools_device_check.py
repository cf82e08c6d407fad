"""``tools/device_check.py`` as a user runs it, here on the CPU: one JSON line with every section,
environment and attention passing on the CPU (Triton under the interpreter, tiny shapes); the whole
check on the emulated device under the 910B's rules (``--device emulated-npu``): the 1-rank RL run
and its resume, the 2-rank bf16 run (distributed optimizer, broadcast sync) and its resume, with a
``--set`` override reaching every RL check; a failing check records its error without hiding the
next one; ``--device npu`` without torch_npu / CANN fails first, saying what to install.

The RL checks run only on the emulated device (the CPU run skips them): the same checks, under
stricter rules, once."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.devcheck import CHECKS
from megatron_rl.devcheck.outcome import CheckOptions

RL_CHECKS = ("rl_hf", "resume", "rl_vllm", "rl_dist", "resume_dist", "rl_vllm_tp2")
MAX_NEW_TOKENS = 6  # the emulated run's --set (the checks' own YAML says 8)

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "device_check.py"


def run_tool(*args: str, env_extra: dict | None = None, timeout: int = 300) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | (env_extra or {})
    proc = subprocess.run(
        [sys.executable, str(TOOL), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.returncode, json.loads(lines[0]), proc.stderr


@pytest.fixture(scope="module")
def cpu_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device_check")
    interpret = {"TRITON_INTERPRET": "1"} if importlib.util.find_spec("triton") else {}
    code, report, stderr = run_tool(
        "--device",
        "cpu",
        "--quick",
        "--skip",
        ",".join(RL_CHECKS),
        "--workdir",
        str(tmp / "work"),
        "--out",
        str(tmp / "out.json"),
        env_extra=interpret,
    )
    assert code == 0, (json.dumps(report)[-4000:], stderr[-2000:])
    assert json.loads((tmp / "out.json").read_text()) == report
    return report


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.vllm
def test_every_section_is_there_and_passes(cpu_report):
    assert cpu_report["device"] == "cpu" and cpu_report["status"] == "pass"
    assert list(cpu_report["summary"]) == list(CHECKS) == list(cpu_report["checks"])
    assert cpu_report["summary"] == {"environment": "pass", "attention": "pass"} | dict.fromkeys(RL_CHECKS, "skip")
    assert all(cpu_report["checks"][name]["reason"] == "--skip" for name in RL_CHECKS)
    assert set(cpu_report["thresholds"]) >= {"attention_rel_tolerance", "resume_rel_tolerance"}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.vllm
def test_environment_reports_versions_and_device(cpu_report):
    env = cpu_report["checks"]["environment"]
    assert set(env["versions"]) >= {
        "torch",
        "torch_npu",
        "vllm",
        "vllm_ascend",
        "apex",
        "transformer_engine",
        "triton",
        "megatron_core",
        "transformers",
    }
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
def test_a_failing_check_does_not_hide_the_next(tmp_path):
    """No CUDA here: environment fails on its threshold, attention on setup_platform's error."""
    code, report, _ = run_tool("--device", "cuda", "--skip", ",".join(RL_CHECKS), "--workdir", str(tmp_path))
    assert code == 1 and report["status"] == "fail"
    assert report["summary"]["environment"] == report["summary"]["attention"] == "fail"
    assert report["checks"]["environment"]["reasons"] == ["torch sees no cuda device"]
    error = report["checks"]["attention"]["error"]
    assert error["type"] == "RuntimeError" and "CUDA" in error["message"] and "device.py" in error["last_frame"]


def test_unknown_check_name_is_refused():
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--device", "cpu", "--skip", "rl_hf,nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "unknown check(s) ['nope']" in proc.stderr


@pytest.fixture(scope="module")
def emulated_npu_report(tmp_path_factory):
    """The whole check on the emulated device under the 910B's rules, as a user would run it on a
    910B, with one ``--set`` override (rl_vllm and rl_vllm_tp2 skip: no vLLM backend, no devices)."""
    tmp = tmp_path_factory.mktemp("device_check_npu")
    code, report, stderr = run_tool(
        "--device",
        "emulated-npu",
        "--quick",
        "--workdir",
        str(tmp / "work"),
        "--set",
        f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        timeout=1200,
    )
    assert code == 0, (json.dumps(report)[-6000:], stderr[-2000:])
    return report


@pytest.mark.slow
@pytest.mark.multiproc
def test_whole_check_passes_on_the_emulated_910b(emulated_npu_report):
    report = emulated_npu_report
    assert report["device"] == "emulated-npu" and report["status"] == "pass"
    assert list(report["summary"]) == list(CHECKS)
    assert report["summary"] == dict.fromkeys(CHECKS, "pass") | {"rl_vllm": "skip", "rl_vllm_tp2": "skip"}
    assert report["checks"]["rl_vllm"]["reason"] == "vLLM has no backend for the emulated device"
    assert "needs 4 GPUs / NPUs" in report["checks"]["rl_vllm_tp2"]["reason"]
    device = report["checks"]["environment"]["device"]
    assert device["type"] == "emulated" and device["profile"] == "npu" and device["count"] >= 2


@pytest.mark.slow
@pytest.mark.multiproc
def test_rl_runs_train_and_resumes_reproduce_them(emulated_npu_report):
    checks = emulated_npu_report["checks"]
    rl, resume = checks["rl_hf"], checks["resume"]
    assert len(rl["steps"]) == 3 and rl["max_weight_change"] > 1e-4
    assert all(s["logprob_gap_mean"] <= 1e-3 and s["step_s"] > 0 for s in rl["steps"])
    assert len(resume["steps"]) == 1 and resume["step3_change"] > 0 and resume["rel_diff"] <= resume["tolerance"]
    dist, resume_dist = checks["rl_dist"], checks["resume_dist"]
    assert dist["world"] == 2 and len(dist["steps"]) == 2 and dist["max_weight_change"] > 1e-4
    assert dist["model_dtypes"] == ["bfloat16"] and dist["master_dtypes"] == ["float32"]
    assert all(s["kl_k3"] <= 0.05 for s in dist["steps"])
    assert len(resume_dist["steps"]) == 1 and resume_dist["step2_change"] > 0
    assert resume_dist["rel_diff"] <= resume_dist["tolerance"]


@pytest.mark.slow
@pytest.mark.multiproc
def test_set_overrides_reach_every_rl_check(emulated_npu_report):
    assert emulated_npu_report["overrides"] == [f"rollout.sampling.max_new_tokens={MAX_NEW_TOKENS}"]
    for name in ("rl_hf", "resume", "rl_dist", "resume_dist"):
        lengths = [s["response_len_max"] for s in emulated_npu_report["checks"][name]["steps"]]
        assert lengths and max(lengths) <= MAX_NEW_TOKENS, (name, lengths)


def test_set_takes_dotted_keys_and_refuses_anything_else():
    from megatron_rl.devcheck.runner import parse_args

    args = parse_args(["--device", "cpu", "--set", "parallel.tp=2", "--set", "attention.backend=split"])
    assert args.overrides == ["parallel.tp=2", "attention.backend=split"]
    opts = CheckOptions(device="npu", quick=False, workdir="/w", overrides=tuple(args.overrides))
    assert CheckOptions.from_json(opts.to_json()) == opts
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--device", "cpu", "--set", "parallel.tp"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "not of the form a.b=value" in proc.stderr


def test_rl_model_has_a_head_dim_vllm_ascend_accepts(tmp_path):
    from megatron_rl.devcheck.rl import tiny_model

    cfg = json.loads(
        (tiny_model(CheckOptions(device="cpu", quick=True, workdir=str(tmp_path))) / "config.json").read_text()
    )
    assert cfg["hidden_size"] // cfg["num_attention_heads"] in (64, 128)
    assert cfg["num_attention_heads"] % 2 == 0 and cfg["num_key_value_heads"] % 2 == 0  # TP 2 divides them


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_device_configs_are_valid_and_place_the_engines(tmp_path, device):
    """The YAMLs the RL checks write for a GPU / NPU machine load (``--set`` included): 2 ranks on
    devices 0, 1 beside an hf engine on device 1 (never rank 0's, the sender's), a TP-2 vLLM
    engine on devices 2, 3, bf16 with the distributed optimizer and broadcast sync."""
    from megatron_rl.config import load_config
    from megatron_rl.devcheck.rl import write_config
    from megatron_rl.devcheck.rl_dist import dist_config

    opts = CheckOptions(device=device, quick=False, workdir=str(tmp_path), overrides=("parallel.tp=2",))
    single = load_config(write_config(opts, "rl_hf", "hf", 3), opts.overrides)
    assert single.model.dtype == "float32" and single.rollout.devices == [f"{device}:0"]
    dist = load_config(dist_config(opts, "rl_dist", "hf", engine_devices="1"), opts.overrides)
    assert (dist.model.dtype, dist.parallel.distributed_optimizer, dist.rollout.weight_sync) == (
        "bfloat16",
        True,
        "broadcast",
    )
    assert dist.parallel.tp == 2 and dist.rollout.devices == [f"{device}:1"]
    assert dist.pipeline.mode == "sync" and dist.pipeline.micro_batch_tokens == 256  # resumable bit for bit
    tp2 = load_config(dist_config(opts, "rl_vllm_tp2", "vllm", engine_devices="2,3", tp=2))
    assert tp2.rollout.tensor_parallel_size == 2 and tp2.rollout.devices == [f"{device}:2,3"]
    assert tp2.rollout.dtype == "bfloat16"


def test_two_rank_checks_skip_without_two_devices(tmp_path):
    from megatron_rl.devcheck.rl_dist import check_resume_dist, check_rl_dist, check_rl_vllm_tp2

    cuda = CheckOptions(device="cuda", quick=True, workdir=str(tmp_path))
    if torch_cuda_devices() >= 2:
        pytest.skip("this machine has 2 GPUs: the checks would run")
    assert check_rl_dist(cuda) == {
        "status": "skip",
        "reason": f"needs 2 cuda devices (2 training ranks), {torch_cuda_devices()} visible",
    }
    assert check_resume_dist(cuda)["reason"].startswith("needs rl_dist's checkpoints")
    assert check_rl_vllm_tp2(cuda)["status"] == "skip"
    cpu = CheckOptions(device="cpu", quick=True, workdir=str(tmp_path))
    assert "needs 4 GPUs / NPUs; cpu has none" in check_rl_vllm_tp2(cpu)["reason"]


def torch_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def test_fp32_master_weights_are_required_of_a_bf16_model_only():
    """``--set model.dtype=float32`` (a documented work-around) has no master copies to save."""
    from megatron_rl.devcheck.rl_dist import master_weight_reasons

    assert master_weight_reasons({"model_dtypes": ["bfloat16"], "master_dtypes": ["float32"]}) == []
    assert master_weight_reasons({"model_dtypes": ["float32"], "master_dtypes": []}) == []
    assert master_weight_reasons({"model_dtypes": ["bfloat16"], "master_dtypes": []}) == [
        "optimizer master weights [], expected fp32 copies of the ['bfloat16'] model"
    ]


def test_first_rank_error_is_the_cause_not_its_echoes():
    from megatron_rl.devcheck.rl_dist import first_rank_error

    text = (
        "W1202 launching\n[rank1]: Traceback (most recent call last):\n"
        "[rank1]: RuntimeError: HCCL AllReduce does not support Double\n"
        "[rank0]: megatron_rl.parallel.world_timeout.WorldTimeout: rank 1 did not answer\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: megatron_rl FAILED\n"
    )
    assert first_rank_error(text) == "RuntimeError: HCCL AllReduce does not support Double"
    assert first_rank_error("all fine\n") is None


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_adaptor_missing_says_what_to_install(tmp_path, monkeypatch):
    from megatron_rl.devcheck.environment import npu_adaptor_problem

    assert npu_adaptor_problem().startswith("torch_npu is not installed: pip install -e '.[npu]'")
    # installed without CANN: importing torch_npu cannot load CANN's libraries
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(
        "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    problem = npu_adaptor_problem()
    assert "does not import" in problem and "libhccl.so" in problem and "set_env.sh" in problem


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_without_its_adaptor_fails_at_the_environment_check(tmp_path):
    code, report, _ = run_tool("--device", "npu", "--workdir", str(tmp_path))
    assert code == 1 and report["summary"]["environment"] == "fail"
    problem = report["checks"]["environment"]["reasons"][0]
    assert problem.startswith("torch_npu is not installed: pip install -e '.[npu]'")
    assert report["checks"]["environment"]["versions"]["torch"].startswith("2.")
    for name in CHECKS[1:]:
        assert report["checks"][name] == {"status": "skip", "reason": f"environment failed: {problem}"}, name
