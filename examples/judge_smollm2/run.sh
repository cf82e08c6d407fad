#!/usr/bin/env bash
# judge_smollm2: the CPU demo's task rewarded by an LLM judge (SmolLM2 judging itself, README
# "Model rewards"). examples/judge_smollm2/run.sh [a.b.c=value ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/cpu_run.sh
source examples/cpu_run.sh
cpu_run judge_smollm2 examples/judge_smollm2/config.yaml "${LOG_DIR:-runs/judge_smollm2}" "$@"
