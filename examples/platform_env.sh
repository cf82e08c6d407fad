# shellcheck shell=bash
# The platform's environment for a training launch, sourced by examples/launch.sh and
# examples/launch_msrun.sh. Every variable keeps a value the caller already exported.
#   PLATFORM        npu | cuda | cpu | auto (default: npu-smi present -> npu, nvidia-smi -> cuda, else cpu)
#   SOCKET_IFNAME   network interface of the cluster network (eth0, bond0, ...): sets HCCL_/NCCL_/GLOO_SOCKET_IFNAME
#   NODE_IP         this node's address on that network: sets HCCL_IF_IP (Ascend)
#   DEVICES_PER_NODE  accelerators per node; ENGINE_DEVICES: how many of node 0's the rollout engines
#                   take (rollout.devices). They give NPROC_PER_NODE (training ranks on this node) unless
#                   it is set: node 0 DEVICES_PER_NODE - ENGINE_DEVICES, other nodes DEVICES_PER_NODE;
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
if [[ -z ${NPROC_PER_NODE:-} ]]; then
  if [[ -n ${DEVICES_PER_NODE:-} ]]; then
    NPROC_PER_NODE=$((NODE_RANK == 0 ? DEVICES_PER_NODE - ENGINE_DEVICES : DEVICES_PER_NODE))
  else
    NPROC_PER_NODE=${NPROC:-1}
  fi
fi
# Training world and this node's first global rank (torchrun counts the same way; msrun workers need them).
if [[ -n ${DEVICES_PER_NODE:-} ]]; then
  TRAIN_WORLD_SIZE=${TRAIN_WORLD_SIZE:-$((NNODES * DEVICES_PER_NODE - ENGINE_DEVICES))}
  RANK_BASE=${RANK_BASE:-$((NODE_RANK == 0 ? 0 : NODE_RANK * DEVICES_PER_NODE - ENGINE_DEVICES))}
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
  cpu) ;;
  *)
    echo "PLATFORM must be npu, cuda, cpu or auto, got '$PLATFORM'" >&2
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
