#!/usr/bin/env bash
# moe_replay_smollm2: NPROC=<ranks> examples/moe_replay_smollm2/run.sh [a.b.c=value ...]
set -euo pipefail
exec "$(dirname "$0")/../launch.sh" "examples/moe_replay_smollm2/config.yaml" "$@"
