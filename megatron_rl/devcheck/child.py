"""A check's own process: ``python -m megatron_rl.devcheck.child CHECK OPTIONS_JSON RESULT_FILE``.

Runs one check and writes its result (a JSON object) to RESULT_FILE. An exception becomes a
``fail`` with its type, message and last frame; only a crash of the process itself (a signal,
``os._exit``) leaves no file, which the runner reports from the exit code and the log.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from megatron_rl.devcheck.outcome import CheckOptions, failed


def check_function(name: str) -> Callable[[CheckOptions], dict]:
    """The function that runs check ``name`` (imported lazily: each pulls in different libraries)."""
    if name == "environment":
        from megatron_rl.devcheck.environment import check_environment

        return check_environment
    if name == "attention":
        from megatron_rl.devcheck.attention import check_attention

        return check_attention
    from megatron_rl.devcheck import rl, rl_dist

    return {
        "rl_hf": rl.check_rl_hf,
        "resume": rl.check_resume,
        "rl_vllm": rl.check_rl_vllm,
        "rl_dist": rl_dist.check_rl_dist,
        "resume_dist": rl_dist.check_resume_dist,
        "rl_vllm_tp2": rl_dist.check_rl_vllm_tp2,
    }[name]


def run_check(name: str, opts: CheckOptions) -> dict:
    """``check(opts)`` with its wall time; any exception is recorded as a failure."""
    start = time.perf_counter()
    try:
        result = check_function(name)(opts)
    except Exception as exc:  # the point of the tool: record it, never hide the next check
        traceback.print_exc()  # the whole traceback goes to the check's log
        result = failed(exc)
    return {**result, "seconds": round(time.perf_counter() - start, 2)}


def main(argv: list[str]) -> int:
    name, options, out = argv
    result = run_check(name, CheckOptions.from_json(options))
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the result is written: do not wait for library threads (vLLM, engines) to wind down
