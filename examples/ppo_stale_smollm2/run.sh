#!/usr/bin/env bash
# ppo_stale_smollm2: NPROC=<ranks> examples/ppo_stale_smollm2/run.sh [a.b.c=value ...]
set -euo pipefail
exec "$(dirname "$0")/../launch.sh" "examples/ppo_stale_smollm2/config.yaml" "$@"
