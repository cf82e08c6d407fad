#!/usr/bin/env bash
# dapo_smollm2: NPROC=<ranks> examples/dapo_smollm2/run.sh [a.b.c=value ...]
set -euo pipefail
exec "$(dirname "$0")/../launch.sh" "examples/dapo_smollm2/config.yaml" "$@"
