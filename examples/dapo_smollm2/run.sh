#!/usr/bin/env bash
# Launch this recipe: NPROC ranks (tp x pp x dp) with torchrun; extra arguments are a.b.c=value
# overrides. The model comes from `python tools/prepare_model.py` (offline SmolLM2-135M).
set -euo pipefail
cd "$(dirname "$0")/../.."
NPROC=${NPROC:-1}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PY:-.venv/bin/python}" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
  -m megatron_rl train "examples/$(basename "$(dirname "$0")")/config.yaml" "$@"
