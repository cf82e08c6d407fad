#!/usr/bin/env bash
# qwen3-30b-a3b-910b with torchrun, on every node (see config.yaml for the layout):
#   MODEL_DIR=/path/to/Qwen3-30B-A3B SNAPSHOT_DIR=/path/on/a/filesystem/every/node/mounts [NNODES=2 NODE_RANK=<rank> MASTER_ADDR=<node 0 address>] examples/recipes/qwen3-30b-a3b-910b/run.sh [a.b.c=value ...]
# Node 0 trains on DEVICES_PER_NODE - ENGINE_DEVICES ranks (the engines take rollout.devices), the
# other nodes on DEVICES_PER_NODE (`python -m megatron_rl plan` prints the layout).
set -euo pipefail
export PLATFORM=${PLATFORM:-npu} NNODES=${NNODES:-2} DEVICES_PER_NODE=${DEVICES_PER_NODE:-8} ENGINE_DEVICES=${ENGINE_DEVICES:-4}
exec "$(dirname "$0")/../../launch.sh" examples/recipes/qwen3-30b-a3b-910b/config.yaml \
  "model.hf_path=${MODEL_DIR:?set MODEL_DIR to the Qwen3-30B-A3B checkpoint directory}" \
  "rollout.snapshot_dir=${SNAPSHOT_DIR:?set SNAPSHOT_DIR to a directory every node mounts (the PP stages on node 1 write weight files the engines on node 0 read)}" "$@"
