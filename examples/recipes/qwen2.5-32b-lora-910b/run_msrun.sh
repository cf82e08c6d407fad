#!/usr/bin/env bash
# qwen2.5-32b-lora-910b with msrun (Ascend), on every node (see config.yaml for the layout):
#   MODEL_DIR=/path/to/Qwen2.5-32B-Instruct examples/recipes/qwen2.5-32b-lora-910b/run_msrun.sh [a.b.c=value ...]
# Node 0 trains on DEVICES_PER_NODE - ENGINE_DEVICES ranks (the engines take rollout.devices), the
# other nodes on DEVICES_PER_NODE (`python -m megatron_rl plan` prints the layout).
set -euo pipefail
export NNODES=${NNODES:-1} DEVICES_PER_NODE=${DEVICES_PER_NODE:-8} ENGINE_DEVICES=${ENGINE_DEVICES:-4}
export LOG_DIR=${LOG_DIR:-runs/qwen2.5-32b-lora-910b/msrun_logs}
exec "$(dirname "$0")/../../launch_msrun.sh" examples/recipes/qwen2.5-32b-lora-910b/config.yaml \
  "model.hf_path=${MODEL_DIR:?set MODEL_DIR to the Qwen2.5-32B-Instruct checkpoint directory}" "$@"
