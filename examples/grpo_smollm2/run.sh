#!/usr/bin/env bash
# grpo_smollm2: NPROC=<ranks> examples/grpo_smollm2/run.sh [a.b.c=value ...]
set -euo pipefail
exec "$(dirname "$0")/../launch.sh" "examples/grpo_smollm2/config.yaml" "$@"
