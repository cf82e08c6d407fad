// Device half of the `emulated` accelerator: current device, memory (host malloc, counted per
// device), the device guard, PrivateUse1 hooks, transfer counters and the zero-copy aliases
// between device tensors and CPU tensors that ops.cpp and backend.cpp compute on.
#include "emulated.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unistd.h>
#include <unordered_set>

namespace emulated {
namespace {

constexpr int kMaxDevices = 64;
thread_local c10::DeviceIndex t_device = 0;  // per thread, as CUDA's current device

std::array<std::atomic<int64_t>, kMaxDevices> g_live{};
std::array<std::atomic<int64_t>, kMaxDevices> g_peak{};
std::atomic<int64_t> g_capacity{-1};  // bytes per device, -1: unlimited
std::atomic<int64_t> g_h2d{0}, g_d2h{0}, g_h2d_bytes{0}, g_d2h_bytes{0}, g_syncs{0};

void check_index(c10::DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "emulated device index ", int(index),
              " out of range: MEGATRON_RL_EMULATED_DEVICES gives ", int(device_count()), " devices");
}

// As c10's CUDA allocator prints sizes: "512 bytes", "20.00 MiB", "2.00 GiB".
std::string format_size(int64_t bytes) {
  char text[32];
  if (bytes < 1024) {
    std::snprintf(text, sizeof(text), "%lld bytes", static_cast<long long>(bytes));
  } else {
    const char* unit = bytes < (1 << 20) ? "KiB" : bytes < (1 << 30) ? "MiB" : "GiB";
    double scale = bytes < (1 << 20) ? 1 << 10 : bytes < (1 << 30) ? 1 << 20 : 1 << 30;
    std::snprintf(text, sizeof(text), "%.2f %s", static_cast<double>(bytes) / scale, unit);
  }
  return text;
}

void account(c10::DeviceIndex index, int64_t delta) {
  int64_t now = g_live[index].fetch_add(delta) + delta;
  int64_t capacity = g_capacity.load(std::memory_order_relaxed);
  if (delta > 0 && capacity >= 0 && now > capacity) {
    g_live[index].fetch_sub(delta);
    TORCH_CHECK_WITH(OutOfMemoryError, false, device_name(), " out of memory. Tried to allocate ", format_size(delta),
                     " (emulated:", int(index), "; ", format_size(capacity), " total capacity; ",
                     format_size(now - delta), " already allocated). The capacity is the profile's or "
                     "MEGATRON_RL_EMULATED_MEMORY_GB (GiB per device)");
  }
  int64_t peak = g_peak[index].load();
  while (now > peak && !g_peak[index].compare_exchange_weak(peak, now)) {
  }
}

// What a device DataPtr's deleter needs: what to free (or release) and what to un-count.
struct Block {
  void* data;
  int64_t nbytes;
  c10::DeviceIndex index;
  c10::Storage host;  // set when the memory belongs to a wrapped host storage
};

void free_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  account(block->index, -block->nbytes);
  if (!block->host) c10::free_cpu(block->data);
  delete block;
}

c10::DataPtr allocate_on(c10::DeviceIndex index, size_t nbytes) {
  check_index(index);
  account(index, static_cast<int64_t>(nbytes));  // may raise OutOfMemoryError: before the host allocation
  void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
  auto* block = new Block{data, static_cast<int64_t>(nbytes), index, {}};
  return {data, block, &free_block, c10::Device(kDevice, index)};
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override { return allocate_on(current_device(), nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
DeviceAllocator g_allocator;

// Pinned host memory: plain host memory whose pointers are remembered, so is_pinned() holds.
std::mutex g_pinned_mutex;
std::unordered_set<const void*> g_pinned;

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* data = nbytes ? c10::alloc_cpu(nbytes) : nullptr;
    if (data) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.insert(data);
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  static void release(void* data) {
    if (!data) return;
    {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.erase(data);
    }
    c10::free_cpu(data);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};
PinnedAllocator g_pinned_allocator;

struct GuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }
  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device old = getDevice();
    if (device.index() != old.index()) setDevice(device);
    return old;
  }
  c10::Device getDevice() const override { return {kDevice, current_device()}; }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kDevice, "emulated device guard given a ", device.type(), " device");
    if (device.index() >= 0) set_device(device.index());
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0) t_device = device.index();
  }
  // One in-order stream per device: everything runs synchronously on the calling thread.
  c10::Stream getStream(c10::Device device) const override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream getDefaultStream(c10::Device device) const override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, device);
  }
  c10::Stream getNewStream(c10::Device device, int) const override { return c10::Stream(c10::Stream::DEFAULT, device); }
  c10::Stream exchangeStream(c10::Stream stream) const override { return c10::Stream(c10::Stream::DEFAULT, stream.device()); }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
};

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override { set_device(index); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    c10::DeviceIndex old = current_device();
    set_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override { return exchangeDevice(index); }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    return g_pinned.count(data) > 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  at::Device getDeviceFromPtr(void*) const override { return {kDevice, current_device()}; }
  // Random ops run CPU kernels (ops.cpp), so the device generator is the CPU generator.
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override { return at::detail::createCPUGenerator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), nbytes);
  }
};

void delete_storage_ref(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

[[maybe_unused]] const bool g_registered = [] {
  c10::SetAllocator(kDevice, &g_allocator);
  at::RegisterPrivateUse1HooksInterface(new Hooks());
  return true;
}();

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex count = [] {
    const char* env = std::getenv("MEGATRON_RL_EMULATED_DEVICES");
    int n = env ? std::atoi(env) : 16;
    return static_cast<c10::DeviceIndex>(std::clamp(n, 1, kMaxDevices));
  }();
  return count;
}

c10::DeviceIndex current_device() { return t_device; }

void set_device(c10::DeviceIndex index) {
  check_index(index);
  t_device = index;
}

c10::Allocator* device_allocator() { return &g_allocator; }

int64_t memory_allocated(c10::DeviceIndex index) {
  check_index(index);
  return g_live[index].load();
}

int64_t max_memory_allocated(c10::DeviceIndex index) {
  check_index(index);
  return g_peak[index].load();
}

void reset_peak_memory(c10::DeviceIndex index) {
  check_index(index);
  g_peak[index].store(g_live[index].load());
}

void set_memory_capacity(int64_t bytes) { g_capacity.store(bytes < 0 ? -1 : bytes); }

int64_t memory_capacity() { return g_capacity.load(); }

int64_t total_memory() {
  int64_t capacity = g_capacity.load();
  if (capacity >= 0) return capacity;
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
}

void count_sync() {
  g_syncs.fetch_add(1, std::memory_order_relaxed);
  count_d2h(8);  // the size (a count) read back to size the output
}

void count_h2d(int64_t bytes) {
  g_h2d.fetch_add(1, std::memory_order_relaxed);
  g_h2d_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void count_d2h(int64_t bytes) {
  g_d2h.fetch_add(1, std::memory_order_relaxed);
  g_d2h_bytes.fetch_add(bytes, std::memory_order_relaxed);
}

Transfers transfers() {
  return {g_h2d.load(), g_d2h.load(), g_h2d_bytes.load(), g_d2h_bytes.load(), g_syncs.load()};
}

void reset_transfers() {
  g_h2d = 0;
  g_d2h = 0;
  g_h2d_bytes = 0;
  g_d2h_bytes = 0;
  g_syncs = 0;
}

at::Tensor cpu_alias(const at::Tensor& device_tensor) {
  const c10::Storage& storage = device_tensor.storage();
  // The alias's DataPtr keeps the device storage alive; the alias storage may be resized by
  // an out= kernel (ops.cpp then moves the device tensor onto the new memory).
  c10::DataPtr data(storage.data_ptr().get(), new c10::Storage(storage), &delete_storage_ref,
                    c10::Device(c10::kCPU));
  auto impl = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), storage.nbytes(),
                                                    std::move(data), c10::GetCPUAllocator(), /*resizable=*/true);
  at::Tensor alias = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(std::move(impl)), c10::DispatchKeySet(c10::DispatchKey::CPU), device_tensor.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(device_tensor.sizes(), device_tensor.strides(),
                                                     device_tensor.storage_offset());
  if (device_tensor.is_conj()) alias._set_conj(true);
  if (device_tensor.is_neg()) alias._set_neg(true);
  return alias;
}

c10::DataPtr wrap_host_data(const c10::Storage& host, c10::DeviceIndex index) {
  check_index(index);
  void* data = host.data_ptr().get();
  auto nbytes = static_cast<int64_t>(host.nbytes());
  account(index, nbytes);
  auto* block = new Block{data, nbytes, index, host};
  return {data, block, &free_block, c10::Device(kDevice, index)};
}

c10::Storage wrap_host_storage(const c10::Storage& host, c10::DeviceIndex index) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), host.nbytes(),
                                                            wrap_host_data(host, index), &g_allocator,
                                                            /*resizable=*/true));
}

at::Tensor device_tensor_on(const c10::Storage& storage, const at::Tensor& meta) {
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage),
                                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                           meta.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(meta.sizes(), meta.strides(), meta.storage_offset());
  if (meta.is_conj()) out._set_conj(true);
  if (meta.is_neg()) out._set_neg(true);
  return out;
}

void resize_storage_bytes(c10::StorageImpl* storage, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  c10::DeviceIndex index = storage->device().index();
  c10::DataPtr fresh = allocate_on(index >= 0 ? index : current_device(), nbytes);
  size_t keep = std::min(nbytes, storage->nbytes());
  if (keep) std::memcpy(fresh.get(), storage->data_ptr().get(), keep);
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

}  // namespace emulated
