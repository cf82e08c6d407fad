#!/usr/bin/env bash
# Launch a recipe with torchrun on this node: examples/launch.sh CONFIG.yaml [a.b.c=value ...]
#
# One node:   NPROC_PER_NODE=4 examples/launch.sh CONFIG.yaml
# Each node:  NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> [MASTER_PORT=29500] \
#               DEVICES_PER_NODE=8 ENGINE_DEVICES=4 examples/launch.sh CONFIG.yaml
# Engine e runs on node rollout.engine_nodes[e] (default: all on node 0, started by global rank 0);
# on a node > 0 this script also starts the node's engine host (`megatron_rl serve`, see
# examples/platform_env.sh). Node n trains on DEVICES_PER_NODE minus its engine devices
# (ENGINE_DEVICES: one count for node 0, or a comma list per node, e.g. "4,4"); NPROC_PER_NODE
# overrides this node's count. `python -m megatron_rl plan CONFIG --nodes N --devices-per-node D
# --device KIND` prints the layout. ROLLOUT_DEVICES, PLATFORM, SOCKET_IFNAME, NODE_IP: see
# examples/platform_env.sh.
# MAX_RESTARTS=N: torchrun restarts the whole world up to N times when a rank dies (OOM, a lost node);
# with trainer.resume_from=auto each restart continues from save_dir's last complete checkpoint.
# MEGATRON_RL_DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [a.b.c=value ...]" >&2
  exit 2
fi
CONFIG=$1; shift
cd "$(dirname "$0")/.."
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_PORT=${MASTER_PORT:-29500}
# shellcheck source=examples/platform_env.sh
source examples/platform_env.sh

if [[ $NNODES == 1 && -z ${MASTER_ADDR:-} ]]; then
  rendezvous=(--standalone)
else
  # static rendezvous: every node names node 0's address; the ranks use torchrun's agent store
  rendezvous=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to node 0}"
              --master_port "$MASTER_PORT")
fi
start_engine_host "$CONFIG" "${ROLLOUT_OVERRIDES[@]}" "$@"
run_or_print "${PY:-.venv/bin/python}" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$NPROC_PER_NODE" \
  --max-restarts "${MAX_RESTARTS:-0}" \
  -m megatron_rl train "$CONFIG" --platform "$PLATFORM" "${ROLLOUT_OVERRIDES[@]}" "$@"
