"""The rule profiles of the emulated device: what a CUDA GPU and an Ascend 910B allow, one table.

Each rule is a frozen dataclass whose ``source`` names the CANN / HCCL / torch_npu code or
document it comes from (torch_npu at github.com/Ascend/pytorch, master of 2026-08 and
v7.3.1-pytorch2.9.0 agree on every row used here). ``PROFILES`` maps a profile name to its
rules; ``megatron_rl.platform.emulated.set_profile`` pushes the chosen row into the C++
extension's global flags (a flag test per op, no string compares), so a process switches
profile at run time without a second device name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1 << 30
TORCH_NPU = "github.com/Ascend/pytorch torch_npu/csrc/distributed"


@dataclass(frozen=True, kw_only=True)
class DeviceComputeRule:
    """Dtypes the device's kernels do not compute: an op (other than data movement) with a device
    tensor of one of them as argument or result raises, naming the op, the device and the fix."""

    refused: tuple[torch.dtype, ...]
    fix: str
    source: str


@dataclass(frozen=True, kw_only=True)
class CollectiveDtypeRule:
    """Dtypes a group of collectives accepts (any other raises as the real process group does)."""

    collectives: tuple[str, ...]  # c10d backend method names
    accepted: tuple[torch.dtype, ...]
    source: str


@dataclass(frozen=True, kw_only=True)
class MissingCollectiveRule:
    """Collectives or reduce ops the real process group does not implement: they raise."""

    collectives: tuple[str, ...]  # c10d backend method names
    reduce_ops: tuple[str, ...]  # torch.distributed.ReduceOp names
    source: str


@dataclass(frozen=True, kw_only=True)
class ContiguityRule:
    """Collectives take contiguous (dense) tensors only."""

    message: str
    source: str


@dataclass(frozen=True, kw_only=True)
class TypeStringRule:
    """What ``Tensor.type()`` (no argument) reads for a device tensor: ``<prefix>.FloatTensor``."""

    prefix: str
    source: str


@dataclass(frozen=True, kw_only=True)
class MemoryRule:
    """Device memory per device (None: unlimited) and the name its out-of-memory error carries;
    ``$MEGATRON_RL_EMULATED_MEMORY_GB`` overrides the capacity."""

    capacity_bytes: int | None
    oom_name: str  # "NPU out of memory. ..." / "CUDA out of memory. ..."
    source: str


@dataclass(frozen=True, kw_only=True)
class HostSyncRule:
    """Ops whose output shape depends on device data: each is a device->host read (counted as a
    d2h transfer and a ``sync``). Counted on every profile: CUDA synchronises there too."""

    ops: tuple[str, ...]
    source: str


@dataclass(frozen=True, kw_only=True)
class Profile:
    """All rules of one target device."""

    name: str
    device_name: str  # how messages name the device: "NPU" / "CUDA"
    compute: DeviceComputeRule | None
    collective_dtypes: tuple[CollectiveDtypeRule, ...]
    missing: MissingCollectiveRule | None
    contiguity: ContiguityRule | None
    type_string: TypeStringRule
    memory: MemoryRule
    host_syncs: HostSyncRule


HOST_SYNCS = HostSyncRule(
    ops=(
        "nonzero",
        "argwhere",
        "unique",
        "masked_select",
        "index with a boolean mask",
        "index_put with a boolean mask",
        "repeat_interleave without output_size",
        "bincount",
    ),
    source="PyTorch aten/src/ATen/native/cuda/Nonzero.cu (cudaMemcpyAsync of the count + stream sync), "
    "Unique.cu, Indexing.cu (expandTensors -> nonzero for byte/bool indices), "
    "Repeat.cu / Repeat.cpp (repeats.sum().item() when output_size is None); torch_npu does the same "
    "(aclnnNonzero returns its count to the host)",
)

REDUCTIONS = (
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced",
)
# torch_npu HCCLUtils.cpp kScalarTypeToHcclDataType: the dtypes any HCCL collective can carry
# (getHcclDataType raises "Unsupported data type for HCCL process group" for the rest).
HCCL_CARRIED = (
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.float32,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float64,
    torch.bool,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
ALL_COLLECTIVES = (
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_into_tensor_coalesced",
    "gather",
    "scatter",
    "alltoall",
    "alltoall_base",
    "send",
    "recv",
    "recvAnysource",
    *REDUCTIONS,
)

NPU_910B = Profile(
    name="npu",
    device_name="NPU",
    compute=DeviceComputeRule(
        refused=(torch.float64,),
        fix="compute in float32 on the device, or in float64 on the host",
        source="CANN ops-math math/expm1/op_host/op_api/expm1.cpp: ASCEND910B_AICORE_DTYPE_SUPPORT_LIST = "
        "{FLOAT, FLOAT16, BF16}; aclnn_expm1.h: self INT64, BOOL, FLOAT, BFLOAT16, FLOAT16 (no DOUBLE); "
        "the 910B AI core has no fp64 units, ops that accept DOUBLE (e.g. aclnnAdds) run on AICPU, "
        "slowly (huggingface/diffusers#10123 'npu not support float64'). Stricter than CANN on purpose: "
        "every fp64 device computation is refused, storage and casts are allowed",
    ),
    collective_dtypes=(
        CollectiveDtypeRule(
            collectives=REDUCTIONS,
            accepted=(torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32, torch.bfloat16),
            source=f"{TORCH_NPU}/ProcessGroupHCCL.cpp checkSupportedDataType (fp64 / uint64 only on Ascend950; "
            "uint8 and bool never): called by allreduce, allreduce_coalesced, reduce, reduce_scatter, "
            "_reduce_scatter_base, reduce_scatter_tensor_coalesced",
        ),
        CollectiveDtypeRule(
            collectives=ALL_COLLECTIVES,
            accepted=HCCL_CARRIED,
            source=f"{TORCH_NPU}/HCCLUtils.cpp kScalarTypeToHcclDataType / getHcclDataType "
            "(allgather and broadcast carry every mapped dtype, fp64 included)",
        ),
    ),
    missing=MissingCollectiveRule(
        collectives=("gather", "recvAnysource"),
        reduce_ops=("BAND", "BOR", "BXOR"),
        source=f"{TORCH_NPU}/ProcessGroupHCCL.cpp: gather throws 'ProcessGroupHCCL does not support gather' "
        "(unless TORCH_NPU_USE_COMPATIBLE_IMPL=1 on A2/A3), recvAnysource 'does not support recv', "
        "unsupportedOp = {BAND, BOR, BXOR} in getHcclReduceOp; scatter and list alltoall exist",
    ),
    contiguity=ContiguityRule(
        message="Tensors must be contiguous",
        source=f"{TORCH_NPU}/ProcessGroupHCCL.cpp check_npu_tensors_different_devices / "
        "check_npu_single_tensor: !t.is_contiguous(t.suggest_memory_format()) raises",
    ),
    type_string=TypeStringRule(
        prefix="torch.npu",
        source="torch_npu renames PrivateUse1 to 'npu' and registers torch.npu.*Tensor types "
        "(torch_npu/csrc/utils/TensorType.cpp: get_module(backend) + '.' + toString(scalarType) + 'Tensor'); "
        "megatron-core compares with torch.cuda.*Tensor, MindSpeed's type_wrapper rewrites the string",
    ),
    memory=MemoryRule(
        capacity_bytes=64 * GIB,
        oom_name="NPU",
        source="Ascend 910B: 64 GB HBM2e per device (Atlas 800T A2 datasheet); torch_npu/csrc/core/npu/"
        "NPUCachingAllocator.cpp: TORCH_CHECK_WITH(OutOfMemoryError, ...) 'NPU out of memory. "
        "Tried to allocate'",
    ),
    host_syncs=HOST_SYNCS,
)

CUDA_H200 = Profile(
    name="cuda",
    device_name="CUDA",
    compute=None,
    collective_dtypes=(),
    missing=None,
    contiguity=None,
    type_string=TypeStringRule(
        prefix="torch.emulated", source="torch's PrivateUse1 type strings (torch.<backend>.FloatTensor)"
    ),
    memory=MemoryRule(
        capacity_bytes=141 * 10**9,
        oom_name="CUDA",
        source="NVIDIA H200: 141 GB HBM3e; c10/cuda/CUDACachingAllocator.cpp 'CUDA out of memory. Tried to allocate'",
    ),
    host_syncs=HOST_SYNCS,
)

PROFILES: dict[str, Profile] = {p.name: p for p in (CUDA_H200, NPU_910B)}
