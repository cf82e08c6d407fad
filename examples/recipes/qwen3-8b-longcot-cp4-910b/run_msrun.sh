#!/usr/bin/env bash
# qwen3-8b-longcot-cp4-910b with msrun (Ascend), on every node (see config.yaml for the layout):
#   MODEL_DIR=/path/to/Qwen3-8B NNODES=2 NODE_RANK=<rank> MASTER_ADDR=<node 0 IP> [NODE_IP=<this node's IP>] \
#     examples/recipes/qwen3-8b-longcot-cp4-910b/run_msrun.sh [a.b.c=value ...]
# Each node trains on 4 NPUs (ENGINE_DEVICES=4,4: its engines take NPUs 4-7; tp 2 × cp 4 over both); node 1 also runs its
# engine host. The engines reach rank 0 (and its weight broadcast) at MASTER_ADDR, given to
# rollout.sync_address (an IP address).
# Every node needs the same secret MEGATRON_RL_ENGINE_KEY (README, "Engines on every node"):
#   export MEGATRON_RL_ENGINE_KEY=$(python -c 'import secrets;print(secrets.token_hex(32))')
set -euo pipefail
export NNODES=${NNODES:-2} DEVICES_PER_NODE=${DEVICES_PER_NODE:-8} ENGINE_DEVICES=${ENGINE_DEVICES:-4,4}
export LOG_DIR=${LOG_DIR:-runs/qwen3-8b-longcot-cp4-910b/msrun_logs}
exec "$(dirname "$0")/../../launch_msrun.sh" examples/recipes/qwen3-8b-longcot-cp4-910b/config.yaml \
  "model.hf_path=${MODEL_DIR:?set MODEL_DIR to the Qwen3-8B checkpoint directory}" \
  "rollout.sync_address=${MASTER_ADDR:?set MASTER_ADDR to the IP address of node 0}" "$@"
