# shellcheck shell=bash
# The platform's environment for a training launch, sourced by examples/launch.sh and
# examples/launch_msrun.sh. Every variable keeps a value the caller already exported.
#   PLATFORM        npu | cuda | cpu | emulated | emulated-npu | auto (default: npu-smi present -> npu, nvidia-smi -> cuda, else cpu)
#   SOCKET_IFNAME   network interface of the cluster network (eth0, bond0, ...): sets HCCL_/NCCL_/GLOO_SOCKET_IFNAME
#   NODE_IP         this node's address on that network: sets HCCL_IF_IP (Ascend)
#   DEVICES_PER_NODE  accelerators per node; ENGINE_DEVICES: how many devices the rollout engines take
#                   on each node, a comma list "n0,n1,..." (one number: node 0 only; rollout.devices and
#                   rollout.engine_nodes place them). They give NPROC_PER_NODE (training ranks on this node)
#                   unless it is set: DEVICES_PER_NODE minus this node's ENGINE_DEVICES entry;
#                   without DEVICES_PER_NODE, NPROC_PER_NODE defaults to NPROC or 1 (CPU recipes).
PLATFORM=${PLATFORM:-auto}
if [[ $PLATFORM == auto ]]; then
  if command -v npu-smi >/dev/null 2>&1; then PLATFORM=npu
  elif command -v nvidia-smi >/dev/null 2>&1; then PLATFORM=cuda
  else PLATFORM=cpu
  fi
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
ENGINE_DEVICES=${ENGINE_DEVICES:-0}
IFS=',' read -r -a _engine_devices <<< "$ENGINE_DEVICES"   # per node; a missing entry is 0
_train_ranks() { echo $((DEVICES_PER_NODE - ${_engine_devices[$1]:-0})); }
if [[ -z ${NPROC_PER_NODE:-} ]]; then
  if [[ -n ${DEVICES_PER_NODE:-} ]]; then
    NPROC_PER_NODE=$(_train_ranks "$NODE_RANK")
  else
    NPROC_PER_NODE=${NPROC:-1}
  fi
fi
# Training world and this node's first global rank (torchrun counts the same way; msrun workers need them).
if [[ -n ${DEVICES_PER_NODE:-} ]]; then
  _world=0; _base=0
  for ((_node = 0; _node < NNODES; _node++)); do
    if ((_node == NODE_RANK)); then _base=$_world; fi
    _world=$((_world + $(_train_ranks "$_node")))
  done
  TRAIN_WORLD_SIZE=${TRAIN_WORLD_SIZE:-$_world}
  RANK_BASE=${RANK_BASE:-$_base}
else
  TRAIN_WORLD_SIZE=${TRAIN_WORLD_SIZE:-$((NNODES * NPROC_PER_NODE))}
  RANK_BASE=${RANK_BASE:-$((NODE_RANK * NPROC_PER_NODE))}
fi
export NNODES NODE_RANK NPROC_PER_NODE TRAIN_WORLD_SIZE RANK_BASE
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if [[ -n ${SOCKET_IFNAME:-} ]]; then
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$SOCKET_IFNAME}
fi

case $PLATFORM in
  npu)
    # CANN toolkit (torch_npu, HCCL) unless the caller's shell already sourced it.
    if [[ -z ${ASCEND_HOME_PATH:-} && -f ${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}/set_env.sh ]]; then
      set +u
      # shellcheck source=/dev/null
      source "${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit}/set_env.sh"
      set -u
    fi
    ASCEND_RT_VISIBLE_DEVICES=${ASCEND_RT_VISIBLE_DEVICES:-$(seq -s, 0 $((${DEVICES_PER_NODE:-8} - 1)))}
    export ASCEND_RT_VISIBLE_DEVICES
    export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}   # s to build a communicator (slow first join)
    export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}         # s a collective may wait (long rollouts)
    if [[ -n ${NODE_IP:-} ]]; then export HCCL_IF_IP=${HCCL_IF_IP:-$NODE_IP}; fi
    if [[ -n ${SOCKET_IFNAME:-} ]]; then export HCCL_SOCKET_IFNAME=${HCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}; fi
    export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}            # two-level operator dispatch pipeline
    export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}            # bind each rank's threads to its NPU's cores
    export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # MindSpeed / megatron comm-compute order
    export HCCL_DETERMINISTIC=${HCCL_DETERMINISTIC:-false}
    ;;
  cuda)
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}   # megatron: keep comm kernels ordered
    if [[ -n ${SOCKET_IFNAME:-} ]]; then export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$SOCKET_IFNAME}; fi
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    ;;
  cpu | emulated | emulated-npu) ;;  # the test suite's accelerator on the CPU, CUDA's or a 910B's rules (megatron_rl.platform.emulated)
  *)
    echo "PLATFORM must be npu, cuda, cpu, emulated, emulated-npu or auto, got '$PLATFORM'" >&2
    exit 2
    ;;
esac
export PLATFORM

# ROLLOUT_DEVICES="npu:4,5;npu:6,7": node 0's engine devices, one entry per engine (overrides
# rollout.devices and rollout.num_engines of the YAML; give every node the same value).
# shellcheck disable=SC2034  # read by the launchers that source this file
ROLLOUT_OVERRIDES=()
if [[ -n ${ROLLOUT_DEVICES:-} ]]; then
  IFS=';' read -r -a _engines <<< "$ROLLOUT_DEVICES"
  _list=$(printf '"%s",' "${_engines[@]}")
  # shellcheck disable=SC2034
  ROLLOUT_OVERRIDES=("rollout.devices=[${_list%,}]" "rollout.num_engines=${#_engines[@]}")
fi

# Nodes > 0 of a multi-node launch: this node's rollout engines (rollout.engine_nodes) run in an
# engine host, `python -m megatron_rl serve CONFIG [overrides] --node-rank N`, in the background; it
# serves the dispatcher on global rank 0 (rollout.sync_address:rollout.engine_port) and exits when
# the run ends (at once when the config places no engine on this node). NODE_IP: its address for the
# weight-sync groups; SERVE_ARGS: more flags of `serve` (e.g. chaos runs: "--chaos-crash 0.1").
# Dry run: printed as ENGINE_HOST_COMMAND.
start_engine_host() {
  if [[ $NNODES -le 1 || $NODE_RANK == 0 ]]; then return 0; fi
  local cmd=("${PY:-.venv/bin/python}" -m megatron_rl serve "$@" --node-rank "$NODE_RANK") extra
  if [[ -n ${NODE_IP:-} ]]; then cmd+=(--address "$NODE_IP"); fi
  read -r -a extra <<< "${SERVE_ARGS:-}"
  cmd+=("${extra[@]}")
  if [[ ${MEGATRON_RL_DRY_RUN:-0} == 1 ]]; then
    echo "export ENGINE_HOST_COMMAND=$(printf '%q ' "${cmd[@]}")"
    return 0
  fi
  "${cmd[@]}" &
}

# MEGATRON_RL_DRY_RUN=1: print the platform environment and the command instead of running it.
run_or_print() {
  if [[ ${MEGATRON_RL_DRY_RUN:-0} == 1 ]]; then
    local name
    for name in PLATFORM TRAIN_WORLD_SIZE RANK_BASE CUDA_DEVICE_MAX_CONNECTIONS NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME ASCEND_RT_VISIBLE_DEVICES \
                HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT HCCL_IF_IP HCCL_SOCKET_IFNAME TASK_QUEUE_ENABLE CPU_AFFINITY_CONF; do
      if [[ -n ${!name:-} ]]; then echo "export $name=${!name}"; fi
    done
    printf '%q ' "$@"
    echo
    exit 0
  fi
  exec "$@"
}
