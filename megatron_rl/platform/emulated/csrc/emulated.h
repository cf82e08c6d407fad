// The `emulated` accelerator: a PrivateUse1 device whose memory is host memory.
// Shared declarations of device.cpp (allocator, guard, hooks, counters),
// ops.cpp (native kernels + the CPU fallback) and backend.cpp (c10d backend).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>

#include <cstdint>

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

// Host<->device copies (a device->host scalar read counts as a d2h copy).
struct Transfers {
  int64_t h2d = 0, d2h = 0, h2d_bytes = 0, d2h_bytes = 0;
};
void count_h2d(int64_t bytes);
void count_d2h(int64_t bytes);
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

// Route structured ops' functional / in-place variants straight to the CPU fallback; returns
// how many ops were registered (idempotent).
int register_direct_ops();

}  // namespace emulated
