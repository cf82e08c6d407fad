// The `emulated` accelerator: a PrivateUse1 device whose memory is host memory.
// Shared declarations of device.cpp (allocator, guard, hooks, counters),
// ops.cpp (native kernels + the CPU fallback) and backend.cpp (c10d backend).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace emulated {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

c10::DeviceIndex current_device();
void set_device(c10::DeviceIndex index);
c10::DeviceIndex device_count();
c10::Allocator* device_allocator();

// Bytes of device memory live now / at peak on `index` (allocations and wrapped host outputs).
int64_t memory_allocated(c10::DeviceIndex index);
int64_t max_memory_allocated(c10::DeviceIndex index);
void reset_peak_memory(c10::DeviceIndex index);

// Device memory capacity per device in bytes (-1: unlimited); an allocation past it raises
// torch.OutOfMemoryError. `total` for mem_get_info: the capacity, or the host's memory.
void set_memory_capacity(int64_t bytes);
int64_t memory_capacity();
int64_t total_memory();

// Host<->device copies (a device->host scalar read counts as a d2h copy); `syncs`: the reads of
// a data-dependent size (nonzero, unique, masked index, ...), also counted as d2h.
struct Transfers {
  int64_t h2d = 0, d2h = 0, h2d_bytes = 0, d2h_bytes = 0, syncs = 0;
};
void count_h2d(int64_t bytes);
void count_d2h(int64_t bytes);
void count_sync();
Transfers transfers();
void reset_transfers();

// A CPU tensor over the same memory as `device_tensor` (same pointer, sizes, strides, offset).
at::Tensor cpu_alias(const at::Tensor& device_tensor);
// A device DataPtr / storage over a host storage's memory; it keeps `host` alive.
c10::DataPtr wrap_host_data(const c10::Storage& host, c10::DeviceIndex index);
c10::Storage wrap_host_storage(const c10::Storage& host, c10::DeviceIndex index);
// A device tensor on `storage` with the dtype, sizes, strides and offset of `meta`.
at::Tensor device_tensor_on(const c10::Storage& storage, const at::Tensor& meta);
// Grow (or shrink) a device storage in place to `nbytes`, keeping its contents.
void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes);

// ---- the active profile's rules (rules.cpp; profiles.py is the table) ----
// Bit i set: ScalarType i is not computed on the device (0 under the cuda profile).
uint64_t refused_compute_mask();
void set_compute_rules(const std::string& profile, const std::string& device_name,
                       const std::vector<c10::ScalarType>& refused, const std::string& fix);
// "NPU" / "CUDA": how out-of-memory errors name the device.
std::string device_name();
// Raise: `op` would compute a refused dtype (`role`: "argument 'self'", "its result") on `device`.
[[noreturn]] void refuse_compute(const std::string& op, c10::Device device, c10::ScalarType type,
                                 const std::string& role);
// Per collective group: the accepted dtypes; collectives and reduce ops that raise; the
// contiguity message (empty: no check).
void set_collective_rules(const std::vector<std::pair<std::vector<std::string>, std::vector<c10::ScalarType>>>& groups,
                          const std::vector<std::string>& missing, const std::vector<int64_t>& missing_reduce_ops,
                          const std::string& contiguity);
// Raise if `collective` on `tensors` (with `reduce_op`, -1 for none) breaks the active rules.
void check_collective(const char* collective, const std::vector<at::Tensor>& tensors, int64_t reduce_op);

// How an op's output size can depend on device data (a device->host read on CUDA and NPU), and
// where in its arguments to look (computed once per schema).
enum class Sync : uint8_t { kNever, kAlways, kBoolIndices, kNoOutputSize };
struct SyncInfo {
  Sync kind = Sync::kNever;
  int sync_arg = -1;                         // kBoolIndices: "indices"; kNoOutputSize: "output_size"
  int values_arg = -1, accumulate_arg = -1;  // index_put: a masked fill does not sync
};
SyncInfo sync_info(const c10::FunctionSchema& schema);
// True when this call (`args`: its arguments on the stack) reads its output size from the device.
bool reads_size(const SyncInfo& info, const c10::IValue* args);
// Ops that only move, cast or fill data (views are recognised by their schema in ops.cpp).
bool moves_data_only(const std::string& name);

// Route structured ops' functional / in-place variants straight to the CPU fallback; returns
// how many ops were registered (idempotent).
int register_direct_ops();

}  // namespace emulated
