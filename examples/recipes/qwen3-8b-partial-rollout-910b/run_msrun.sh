#!/usr/bin/env bash
# qwen3-8b-partial-rollout-910b with msrun (Ascend), on every node (see config.yaml for the layout):
#   MODEL_DIR=/path/to/Qwen3-8B [NNODES=2 NODE_RANK=<rank> MASTER_ADDR=<node 0 address>] examples/recipes/qwen3-8b-partial-rollout-910b/run_msrun.sh [a.b.c=value ...]
# Node 0 trains on DEVICES_PER_NODE - ENGINE_DEVICES ranks (the engines take rollout.devices), the
# other nodes on DEVICES_PER_NODE (`python -m megatron_rl plan` prints the layout).
set -euo pipefail
export NNODES=${NNODES:-2} DEVICES_PER_NODE=${DEVICES_PER_NODE:-8} ENGINE_DEVICES=${ENGINE_DEVICES:-4}
export LOG_DIR=${LOG_DIR:-runs/qwen3-8b-partial-rollout-910b/msrun_logs}
exec "$(dirname "$0")/../../launch_msrun.sh" examples/recipes/qwen3-8b-partial-rollout-910b/config.yaml \
  "model.hf_path=${MODEL_DIR:?set MODEL_DIR to the Qwen3-8B checkpoint directory}" "$@"
