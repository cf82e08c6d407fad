"""The 2-rank RL checks: the paths one fp32 rank never takes, on the model of ``rl.py`` (head_dim 64).

- ``rl_dist``: a world of 2 training ranks started as a user starts one (``torchrun -m megatron_rl
  train``): data-parallel 2 (the dispatcher splits each batch between 2 replicas; gradients and the
  loss totals are all-reduced over the device's collectives), ``model.dtype: bfloat16`` with fp32
  master weights, megatron's distributed optimizer (its state sharded over the replicas),
  ``rollout.weight_sync: broadcast`` (buckets over NCCL / HCCL; gloo to CPU engines), a checkpoint
  every step; 2 steps, ``pipeline.mode: sync`` (periodic mode is ``rl_hf``'s). ``--set parallel.tp=2``
  makes it TP 2 (the model's 2 heads allow it).
- ``resume_dist``: a new 2-rank world resumes ``rl_dist``'s step-1 checkpoint for 1 step; its
  weights must equal ``rl_dist``'s step 2 (``rl.resume_figures``).
- ``rl_vllm_tp2``: the same 2 ranks on devices 0, 1 feeding a vLLM engine at tensor-parallel 2 on
  devices 2, 3 by broadcast; needs 4 devices and vLLM (vllm-ascend on NPU).

On a GPU / NPU machine each rank takes device ``LOCAL_RANK`` and the hf engine device 1 (an NCCL /
HCCL group cannot have two members on one device, and rank 0 is the sender); a check skips, saying
so, when fewer devices are visible. Rank output goes to ``logs/<check>_ranks.log``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from megatron_rl.devcheck.outcome import CheckOptions, judged, skipped
from megatron_rl.devcheck.rl import (
    judge_steps,
    load_weights,
    max_change,
    resume_figures,
    resume_overrides,
    step_figures,
    tiny_model,
    vllm_missing,
    write_config,
)

WORLD = 2  # training ranks
# parallel.timeout_s of the checks' worlds: a hung collective becomes an error naming the rank well
# inside the runner's limit for the check (runner.CHECK_LIMIT_S)
WORLD_TIMEOUT_S = 240.0
ERROR_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")


class WorldFailed(RuntimeError):
    """The training world exited non-zero; the message has the first error a rank printed."""


def visible_devices(device: str) -> int | None:
    """Devices torch sees on ``cuda`` / ``npu``; None elsewhere (a CPU or emulated world needs none)."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    if device == "npu":
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu.device_count()  # type: ignore[attr-defined]
    return None


def too_few_devices(opts: CheckOptions, needed: int, why: str) -> str | None:
    """The skip reason when fewer than ``needed`` devices are visible (None: enough)."""
    count = visible_devices(opts.device)
    if count is None or count >= needed:
        return None
    return f"needs {needed} {opts.device} devices ({why}), {count} visible"


def dist_config(opts: CheckOptions, name: str, engine: str, *, engine_devices: str, tp: int = 1) -> Path:
    """The YAML of a 2-rank check: ``rl.write_config``'s run in bf16 (fp32 master weights) with the
    distributed optimizer, broadcast weight sync and an engine at TP ``tp`` on ``engine_devices``."""
    rollout: dict = {"weight_sync": "broadcast", "tensor_parallel_size": tp}
    if opts.accelerator:
        rollout["devices"] = [f"{opts.device}:{engine_devices}"]
    # sync mode: micro-batches packed in prompt order, so a resumed step sums its bf16 gradients in
    # the straight run's order (periodic packs in arrival order: two straight runs differ by ~1 bf16 ulp)
    extra = {
        "model": {"dtype": "bfloat16"},
        "rollout": rollout,
        "pipeline": {"mode": "sync"},
        "parallel": {"distributed_optimizer": True, "timeout_s": WORLD_TIMEOUT_S},
    }
    return write_config(opts, name, engine, 2, extra=extra)


def first_rank_error(text: str) -> str | None:
    """The first ``SomeError: message`` line of the ranks' output (the cause; later ones are mostly
    its echoes: peers timing out, torchrun's ChildFailedError)."""
    for line in text.splitlines():
        match = ERROR_LINE.match(line.strip())
        if match and not match.group(1).endswith("ChildFailedError"):
            return f"{match.group(1)}: {match.group(2)}"[:1500]
    return None


def run_world(opts: CheckOptions, config: Path, name: str, overrides: list[str] = ()) -> list[dict]:
    """Train ``config`` (then ``--set``, then ``overrides``) in a ``WORLD``-rank torchrun world, as
    ``torchrun -m megatron_rl train`` runs it; the per-step metrics rank 0 logged."""
    log_dir, ranks_log = opts.work / f"{name}_logs", opts.work / "logs" / f"{name}_ranks.log"
    shutil.rmtree(log_dir, ignore_errors=True)  # metrics.jsonl is appended to
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        "-m",
        "megatron_rl",
        "train",
        str(config),
        *opts.overrides,
        *overrides,
        f"trainer.log_dir={log_dir}",
        "--platform",
        opts.device,
    ]
    print("[rl_dist] " + " ".join(cmd), flush=True)
    with ranks_log.open("w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        error = first_rank_error(ranks_log.read_text(errors="replace")) or "no error line found"
        raise WorldFailed(
            f"the {WORLD}-rank world exited with status {code}; first error: {error} (every rank's output: {ranks_log})"
        )
    metrics = log_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def master_weights(checkpoint: Path) -> dict:
    """The dtypes of a checkpoint's model weights and of the optimizer's master copies (``param/``)."""
    model = {str(t.dtype).removeprefix("torch.") for t in load_weights(checkpoint / "model").values()}
    state = load_weights(checkpoint / "optimizer")
    master = {str(t.dtype).removeprefix("torch.") for k, t in state.items() if k.startswith("param/")}
    return {"model_dtypes": sorted(model), "master_dtypes": sorted(master)}


def master_weight_reasons(dtypes: dict) -> list[str]:
    """A model not in fp32 (bf16 unless ``--set model.dtype=float32``) must have saved fp32 master weights."""
    if dtypes["model_dtypes"] == ["float32"] or dtypes["master_dtypes"] == ["float32"]:
        return []
    return [
        f"optimizer master weights {dtypes['master_dtypes']}, expected fp32 copies of the "
        f"{dtypes['model_dtypes']} model"
    ]


def check_rl_dist(opts: CheckOptions) -> dict:
    """2 steps at DP 2, bf16 + fp32 master weights, distributed optimizer, broadcast sync."""
    if reason := too_few_devices(opts, WORLD, f"{WORLD} training ranks"):
        return skipped(reason)
    history = run_world(opts, dist_config(opts, "rl_dist", "hf", engine_devices="1"), "rl_dist")
    reasons = judge_steps(history, 2, bf16_engine=True)
    out = opts.work / "rl_dist"
    dtypes = master_weights(out / "step_2")
    reasons += master_weight_reasons(dtypes)
    moved = max_change(load_weights(out / "step_2" / "model"), load_weights(tiny_model(opts)))
    if not moved > 1e-4:
        reasons.append(f"training did not move the weights (max change {moved:.2e})")
    return judged({"world": WORLD, "steps": step_figures(history), "max_weight_change": moved, **dtypes}, reasons)


def check_resume_dist(opts: CheckOptions) -> dict:
    """A new 2-rank world continues ``rl_dist``'s step-1 checkpoint for 1 step == its step 2."""
    straight = opts.work / "rl_dist"
    if not (straight / "step_2" / "model").is_dir() or not (straight / "step_1").is_dir():
        return skipped("needs rl_dist's checkpoints (rl_dist was skipped or failed)")
    history = run_world(
        opts, opts.work / "rl_dist.yaml", "resume_dist", resume_overrides(opts, straight, 1, "resume_dist")
    )
    figures, reasons = resume_figures(straight, opts.work / "resume_dist", 2)
    return judged(
        {"world": WORLD, "steps": step_figures(history), **figures}, judge_steps(history, 1, bf16_engine=True) + reasons
    )


def check_rl_vllm_tp2(opts: CheckOptions) -> dict:
    """2 steps, the 2 ranks on devices 0, 1 syncing by broadcast into a vLLM engine at TP 2 on 2, 3."""
    if not opts.accelerator:
        return skipped(f"an engine at TP 2 beside {WORLD} training ranks needs 4 GPUs / NPUs; {opts.device} has none")
    if reason := vllm_missing(opts.device) or too_few_devices(opts, 4, "2 training ranks + a TP-2 engine"):
        return skipped(reason)
    history = run_world(opts, dist_config(opts, "rl_vllm_tp2", "vllm", engine_devices="2,3", tp=2), "rl_vllm_tp2")
    return judged(
        {"world": WORLD, "engine_tp": 2, "steps": step_figures(history)}, judge_steps(history, 2, bf16_engine=True)
    )
