#!/usr/bin/env bash
# qwen3-8b-partial-rollout-910b with torchrun, on every node (see config.yaml for the layout):
#   MODEL_DIR=/path/to/Qwen3-8B [NNODES=2 NODE_RANK=<rank> MASTER_ADDR=<node 0 address>] examples/recipes/qwen3-8b-partial-rollout-910b/run.sh [a.b.c=value ...]
# Node 0 trains on DEVICES_PER_NODE - ENGINE_DEVICES ranks (the engines take rollout.devices), the
# other nodes on DEVICES_PER_NODE (`python -m megatron_rl plan` prints the layout).
set -euo pipefail
export PLATFORM=${PLATFORM:-npu} NNODES=${NNODES:-2} DEVICES_PER_NODE=${DEVICES_PER_NODE:-8} ENGINE_DEVICES=${ENGINE_DEVICES:-4}
exec "$(dirname "$0")/../../launch.sh" examples/recipes/qwen3-8b-partial-rollout-910b/config.yaml \
  "model.hf_path=${MODEL_DIR:?set MODEL_DIR to the Qwen3-8B checkpoint directory}" "$@"
