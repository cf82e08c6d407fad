"""Run the device checks, each in its own process, and print the report as one JSON line.

A check that raises is a ``fail`` with the error (``child.py``); one that crashes or outlives
its time is a ``fail`` with the exit code and the tail of its log (``<workdir>/logs``). The run
stops starting checks when ``--budget-s`` is spent (the rest: ``skip``). Exit status 0 when no
check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_rl.devcheck import CHECKS, DEVICES
from megatron_rl.devcheck.outcome import CheckOptions, skipped

# seconds a check may take at most on a device (the whole run is also capped by --budget-s)
CHECK_LIMIT_S = {
    "environment": 120,
    "attention": 300,
    "rl_hf": 300,
    "resume": 180,
    "rl_vllm": 360,
    "rl_dist": 420,
    "resume_dist": 300,
    "rl_vllm_tp2": 480,
}
LOG_TAIL_LINES = 25


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tools/device_check.py",
        description="First run on a device: environment, attention kernels, a tiny RL "
        "run with checkpoint resume; one JSON line, exit 0 when nothing fails.",
    )
    p.add_argument("--device", required=True, choices=DEVICES)
    p.add_argument("--skip", default="", help=f"comma-separated checks to skip, of: {','.join(CHECKS)}")
    p.add_argument("--out", default=None, help="also write the JSON report to this file")
    p.add_argument("--quick", action="store_true", help="tiny attention shapes on a device (always tiny on cpu)")
    p.add_argument("--workdir", default=None, help="models, checkpoints, logs (default: a new temp dir, kept)")
    p.add_argument("--budget-s", type=float, default=900.0, help="start no check after this many seconds")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of the RL checks' own YAML (repeatable), e.g. --set attention.backend=split",
    )
    args = p.parse_args(argv)
    unknown = sorted(set(filter(None, args.skip.split(","))) - set(CHECKS))
    if unknown:
        p.error(f"--skip: unknown check(s) {unknown}; the checks are {', '.join(CHECKS)}")
    if bad := [o for o in args.overrides if not re.fullmatch(r"[A-Za-z_][\w.]*=.*", o)]:
        p.error(f"--set: {bad} not of the form a.b=value (a dotted config key, '=', the value)")
    return args


def log_tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join(lines[-LOG_TAIL_LINES:])


def _kill_group(pid: int) -> None:
    """End the check's process group (the child and any engine workers it left)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(name: str, opts: CheckOptions, timeout_s: float) -> dict:
    """Run check ``name`` in a fresh process (own session); its result, or a fail saying how it died."""
    logs = opts.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result_file, log = logs / f"{name}.json", logs / f"{name}.log"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("MEGATRON_RL_PLATFORM", None)  # --device decides (setup_platform would let this override it)
    cmd = [sys.executable, "-m", "megatron_rl.devcheck.child", name, opts.to_json(), str(result_file)]
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code, timed_out = proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            code, timed_out = None, True
        _kill_group(proc.pid)
        proc.wait()
    if result_file.is_file():
        return {**json.loads(result_file.read_text()), "log": str(log)}
    how = f"timed out after {timeout_s:.0f} s" if timed_out else f"process died with exit code {code}"
    return {
        "status": "fail",
        "seconds": round(time.perf_counter() - start, 2),
        "log": str(log),
        "error": {"type": "Crash", "message": how, "last_frame": None, "log_tail": log_tail(log)},
    }


def thresholds() -> dict:
    """The pass / fail thresholds, for the report (read from the checks' modules)."""
    from megatron_rl.devcheck import rl
    from megatron_rl.devcheck.attention import TOLERANCE

    return {
        "attention_rel_tolerance": TOLERANCE,
        "resume_rel_tolerance": rl.RESUME_TOLERANCE,
        "fp32_engine_logprob_gap_mean": rl.FP32_LOGPROB_GAP,
        "bf16_engine_kl_k3": rl.BF16_KL,
    }


def run_checks(args: argparse.Namespace, opts: CheckOptions) -> dict[str, dict]:
    skip, start, results, gone = set(filter(None, args.skip.split(","))), time.perf_counter(), {}, None
    for name in CHECKS:
        left = args.budget_s - (time.perf_counter() - start)
        if name in skip:
            results[name] = skipped("--skip")
        elif gone and name != "environment":
            results[name] = skipped(gone)
        elif left < 10:
            results[name] = skipped(f"out of time: --budget-s {args.budget_s:.0f} spent")
        else:
            results[name] = run_child(name, opts, min(CHECK_LIMIT_S[name], left))
        if results[name].get("device_available") is False:  # the environment check found no such device
            gone = results[name].get("reason") or f"environment failed: {results[name]['reasons'][0]}"
        print(
            f"[device_check] {name}: {results[name]['status']} ({results[name].get('seconds', 0)} s)",
            file=sys.stderr,
            flush=True,
        )
    return results


def overall(results: dict[str, dict]) -> str:
    statuses = {r["status"] for r in results.values()}
    return "fail" if "fail" in statuses else "pass" if "pass" in statuses else "skip"


def main(argv=None) -> int:
    args = parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="device_check_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    opts = CheckOptions(device=args.device, quick=args.quick, workdir=str(workdir), overrides=tuple(args.overrides))
    start = time.perf_counter()
    results = run_checks(args, opts)
    report = {
        "device": args.device,
        "status": overall(results),
        "overrides": args.overrides,
        "summary": {name: r["status"] for name, r in results.items()},
        "seconds": round(time.perf_counter() - start, 1),
        "workdir": str(workdir),
        "thresholds": thresholds(),
        "checks": results,
    }
    line = json.dumps(report)
    print(line, flush=True)
    if args.out:
        Path(args.out).write_text(line + "\n")
    return 1 if report["status"] == "fail" else 0
