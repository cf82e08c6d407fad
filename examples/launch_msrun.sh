#!/usr/bin/env bash
# Launch a recipe with msrun (Ascend) on this node: examples/launch_msrun.sh CONFIG.yaml [a.b.c=value ...]
#
# Each node:  NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0 address> [MASTER_PORT=29500] \
#               DEVICES_PER_NODE=8 ENGINE_DEVICES=4 examples/launch_msrun.sh CONFIG.yaml
# Node n trains on DEVICES_PER_NODE minus its engine devices (ENGINE_DEVICES: node 0's count, or a
# comma list per node; rollout.engine_nodes places the engines, a node > 0's run in the engine host
# this script starts there; see examples/platform_env.sh). msrun starts this
# node's workers (and, on the master node, a scheduler process running the same command). Each
# worker re-enters this script, which sets the torch.distributed variables (RANK = RANK_BASE +
# LOCAL_RANK: msrun's own RANK_ID assumes equal nodes; WORLD_SIZE = TRAIN_WORLD_SIZE; MASTER_ADDR /
# MASTER_PORT = msrun's scheduler address) and execs the trainer; the scheduler (MS_ROLE=MS_SCHED)
# exits at once: torch_npu ranks rendezvous through MASTER_ADDR, not MindSpore's scheduler.
# LOG_DIR (default runs/msrun_logs) gets one log per worker. ROLLOUT_DEVICES, SOCKET_IFNAME, NODE_IP:
# see examples/platform_env.sh. MEGATRON_RL_DRY_RUN=1 prints the msrun command instead of running it.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$SELF")/.."
PY=${PY:-.venv/bin/python}

case ${MS_ROLE:-} in
  MS_SCHED) exit 0 ;;
  MS_WORKER)
    export WORLD_SIZE=${TRAIN_WORLD_SIZE:?} RANK=$((${RANK_BASE:?} + ${LOCAL_RANK:?}))
    export MASTER_ADDR=$MS_SCHED_HOST MASTER_PORT=$MS_SCHED_PORT LOCAL_WORLD_SIZE=${NPROC_PER_NODE:?}
    exec "$PY" -m megatron_rl train "$@"
    ;;
esac

if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [a.b.c=value ...]" >&2
  exit 2
fi
CONFIG=$1; shift
DEVICES_PER_NODE=${DEVICES_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
LOG_DIR=${LOG_DIR:-runs/msrun_logs}
PLATFORM=${PLATFORM:-npu}
# shellcheck source=examples/platform_env.sh
source examples/platform_env.sh
export PY

start_engine_host "$CONFIG" "${ROLLOUT_OVERRIDES[@]}" "$@"
# msrun has no restart option of its own (its flags stop at --tail_worker_log): MAX_RESTARTS=N runs it
# again, on every node, up to N times after a failed run (a dead rank ends the whole job: --join=True);
# with trainer.resume_from=auto each run continues from save_dir's last complete checkpoint.
restarts=0
until (run_or_print msrun --worker_num="$TRAIN_WORLD_SIZE" --local_worker_num="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" --log_dir="$LOG_DIR" \
  --join=True --cluster_time_out="${CLUSTER_TIME_OUT:-600}" \
  "$SELF" "$CONFIG" --platform "$PLATFORM" "${ROLLOUT_OVERRIDES[@]}" "$@"); do  # ( ): run_or_print execs
  if (( restarts >= ${MAX_RESTARTS:-0} )); then
    exit 1
  fi
  restarts=$((restarts + 1))
  echo "launch_msrun.sh: msrun failed; restart $restarts of $MAX_RESTARTS" >&2
done
