#!/usr/bin/env bash
# Launch a recipe: examples/launch.sh CONFIG.yaml [a.b.c=value ...]
# NPROC ranks (tp x pp x dp) with torchrun; the model comes from `python tools/prepare_model.py`.
set -euo pipefail
CONFIG=$1; shift
cd "$(dirname "$0")/.."
NPROC=${NPROC:-1}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PY:-.venv/bin/python}" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  -m megatron_rl train "$CONFIG" "$@"
