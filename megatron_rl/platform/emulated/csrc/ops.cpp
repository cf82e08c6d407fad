// Operators of the `emulated` device. A few are native (allocation, views, resize, set_,
// copies, scalar reads); every other op goes through `fallback`, which runs the CPU kernel
// on zero-copy CPU aliases of the device tensors, wraps fresh CPU outputs as device tensors
// without copying, and enforces CUDA's device rule: no dim > 0 host tensor in a device op, and
// the active profile's (rules.cpp): no refused dtype in an op that computes; host syncs counted.
#include "emulated.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace emulated {
namespace {

c10::DeviceIndex index_of(std::optional<c10::Device> device) {
  return device && device->has_index() ? device->index() : current_device();
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout>, std::optional<c10::Device> device, std::optional<bool>,
                               std::optional<c10::MemoryFormat> memory_format) {
  c10::DeviceGuard guard(c10::Device(kDevice, index_of(device)));
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  c10::DeviceGuard guard(c10::Device(kDevice, index_of(device)));
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Make `self`'s storage hold at least what its sizes, strides and offset reach.
void ensure_storage(const at::Tensor& self) {
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(), self.dtype().itemsize(),
                                                   self.storage_offset());
  if (self.numel() && needed > self.storage().nbytes()) resize_storage_bytes(self.storage().unsafeGetStorageImpl(), needed);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != size || !self.is_contiguous()) impl->set_sizes_contiguous(size);
  ensure_storage(self);
  if (memory_format) {
    TORCH_CHECK(*memory_format != c10::MemoryFormat::Preserve, "Unsupported memory format ", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                               c10::IntArrayRef stride) {
  TORCH_CHECK(!source.data_ptr().get() || source.device().type() == kDevice,
              "set_: cannot set an emulated tensor to a storage on ", source.device());
  auto* impl = self.unsafeGetTensorImpl();
  if (!impl->storage().is_alias_of(source)) impl->set_storage_keep_dtype(std::move(source));
  if (stride.empty()) {
    impl->set_sizes_contiguous(size);
  } else {
    impl->set_sizes_and_strides(size, stride);
  }
  impl->set_storage_offset(offset);
  ensure_storage(self);
  return self;
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  int64_t numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage_offset(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  if (self.is_same(source)) return self;
  return set_storage_offset(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return set_storage_offset(self, std::move(storage), 0, {0}, {});
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool src_on_device = self.device().type() == kDevice, dst_on_device = dst.device().type() == kDevice;
  TORCH_CHECK((src_on_device || self.is_cpu()) && (dst_on_device || dst.is_cpu()), "copy from ", self.device(),
              " to ", dst.device(), " is not supported by the emulated device");
  at::Tensor dst_cpu = dst_on_device ? cpu_alias(dst) : dst;
  dst_cpu.copy_(src_on_device ? cpu_alias(self) : self, non_blocking);
  if (!src_on_device) count_h2d(static_cast<int64_t>(self.nbytes()));
  if (!dst_on_device) count_d2h(static_cast<int64_t>(self.nbytes()));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  count_d2h(static_cast<int64_t>(self.dtype().itemsize()));
  return at::_local_scalar_dense(cpu_alias(self));
}

void record_stream(at::Tensor&, c10::Stream) {}  // one synchronous stream: nothing to record

// ---- the fallback -----------------------------------------------------------------------

// What the fallback needs to know about an operator, computed once per thread and schema.
struct OpInfo {
  std::string name;                // "aten::add.Tensor", for messages
  std::vector<int> returns_arg;    // per return: the mutated argument it is (in-place / out=), or -1
  std::vector<bool> mutated;       // per argument: written by the op
  int host_indices_arg = -1;       // index ops: the "indices" argument may live on the host
  bool reads_scalar = false;       // returns a number read from device memory (a device->host sync)
  bool moves_data = false;         // copies, casts, fills, views: exempt from the dtype rule
  SyncInfo sync;                   // whether its output size depends on device data
};

OpInfo make_info(const c10::FunctionSchema& schema) {
  OpInfo info;
  info.name = schema.operator_name().name;
  if (!schema.overload_name().empty()) info.name += "." + schema.overload_name();
  const auto& args = schema.arguments();
  for (const auto& arg : args) info.mutated.push_back(arg.alias_info() && arg.alias_info()->isWrite());
  for (const auto& ret : schema.returns()) {
    int found = -1;
    if (ret.alias_info() && ret.alias_info()->isWrite()) {
      for (size_t j = 0; j < args.size() && found < 0; ++j) {
        if (args[j].alias_info() && args[j].alias_info()->beforeSets() == ret.alias_info()->beforeSets()) found = j;
      }
    }
    info.returns_arg.push_back(found);
    auto kind = ret.type()->kind();
    bool number = kind == c10::TypeKind::BoolType || kind == c10::TypeKind::IntType ||
                  kind == c10::TypeKind::FloatType || kind == c10::TypeKind::NumberType;
    info.reads_scalar |= number && info.name.rfind("aten::is_", 0) != 0;
    info.moves_data |= ret.alias_info() && !ret.alias_info()->isWrite();  // a view
  }
  info.moves_data |= moves_data_only(schema.operator_name().name);
  info.sync = sync_info(schema);
  static const char* kIndexOps[] = {"aten::index",           "aten::index_put_",      "aten::index_put",
                                    "aten::_index_put_impl_", "aten::_unsafe_index",   "aten::_unsafe_index_put"};
  for (const char* op : kIndexOps) {
    if (schema.operator_name().name != op) continue;
    for (size_t j = 0; j < args.size(); ++j) {
      if (args[j].name() == "indices") info.host_indices_arg = static_cast<int>(j);
    }
  }
  return info;
}

const OpInfo& op_info(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, OpInfo> cache;
  const c10::FunctionSchema* key = &op.schema();
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, make_info(op.schema())).first;
  return it->second;
}

// One fallback call: the device seen, the first host culprit, and alias <-> device storages.
struct Call {
  const OpInfo& info;
  const c10::FunctionSchema& schema;
  uint64_t refused = 0;  // dtypes this op may not compute (0: data movement, or the cuda profile)
  c10::DeviceIndex device = -1;
  int host_arg = -1;
  int refused_arg = -1;  // the first device tensor argument of a refused dtype, and its dtype
  c10::ScalarType refused_type = at::kDouble;
  std::vector<std::pair<const c10::StorageImpl*, c10::Storage>> storages;  // host storage -> device storage

  void mismatch(const std::string& other, int arg) const {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                c10::Device(kDevice, device), " and ", other, "! (in ", info.name, ", argument '",
                schema.arguments()[arg].name(), "')");
  }

  void note_device(c10::DeviceIndex index, int arg) {
    if (device < 0) {
      device = index;
    } else if (index != device) {
      mismatch(c10::Device(kDevice, index).str(), arg);
    }
  }

  // The IValue to hand the CPU kernel for one tensor argument (or the tensor itself).
  at::Tensor lower(const at::Tensor& t, int arg) {
    if (!t.defined()) return t;
    if (t.device().type() == kDevice) {
      note_device(t.device().index(), arg);
      if (refused && ((refused >> static_cast<int>(t.scalar_type())) & 1) && refused_arg < 0) {
        refused_arg = arg;
        refused_type = t.scalar_type();
      }
      at::Tensor alias = cpu_alias(t);
      storages.emplace_back(alias.storage().unsafeGetStorageImpl(), t.storage());
      return alias;
    }
    if (t.is_cpu() && t.dim() > 0 && arg != info.host_indices_arg && host_arg < 0) host_arg = arg;
    return t;
  }

  // Replace device tensors in argument `arg` by CPU aliases; false when nothing changed.
  bool lower(c10::IValue& value, int arg) {
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (!t.defined()) return false;
      bool on_device = t.device().type() == kDevice;
      at::Tensor low = lower(t, arg);
      if (on_device) value = std::move(low);
      return on_device;
    }
    if (value.isDevice()) {
      c10::Device d = value.toDevice();
      if (d.type() != kDevice) return false;
      note_device(d.has_index() ? d.index() : current_device(), arg);
      value = c10::IValue(c10::Device(c10::kCPU));
      return true;
    }
    if (!value.isList()) return false;
    c10::impl::GenericList list = value.toList();
    bool changed = false;
    c10::impl::GenericList lowered(list.elementType());
    lowered.reserve(list.size());
    for (const c10::IValue& item : list) {
      c10::IValue low = item;
      changed |= lower(low, arg);
      lowered.push_back(std::move(low));
    }
    if (changed) value = c10::IValue(std::move(lowered));
    return changed;
  }

  // A CPU result as a device tensor: a view of an input's device storage or wrapped memory.
  c10::IValue lift(const c10::IValue& value) {
    if (value.isTensor()) {
      const at::Tensor& t = value.toTensor();
      if (!t.defined() || !t.is_cpu()) return value;
      const c10::StorageImpl* host = t.storage().unsafeGetStorageImpl();
      for (const auto& [alias, storage] : storages) {
        if (alias == host) return device_tensor_on(storage, t);
      }
      c10::Storage storage = wrap_host_storage(t.storage(), device);
      storages.emplace_back(host, storage);
      return device_tensor_on(storage, t);
    }
    if (!value.isList()) return value;
    c10::impl::GenericList list = value.toList();
    c10::impl::GenericList lifted(list.elementType());
    lifted.reserve(list.size());
    for (const c10::IValue& item : list) lifted.push_back(lift(item));
    return c10::IValue(std::move(lifted));
  }
};

// After the kernel: a mutated argument whose alias was resized or restrided (out= kernels,
// in-place metadata ops) passes the change on to the device tensor.
void write_back(const at::Tensor& device_tensor, const at::Tensor& alias) {
  if (!device_tensor.defined() || !alias.defined()) return;
  auto* impl = device_tensor.unsafeGetTensorImpl();
  c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
  const c10::StorageImpl* host = alias.storage().unsafeGetStorageImpl();
  if (host->data_ptr().get() != storage->data_ptr().get() || host->nbytes() != storage->nbytes()) {
    storage->set_data_ptr_noswap(wrap_host_data(alias.storage(), storage->device().index()));
    storage->set_nbytes(host->nbytes());
  }
  if (device_tensor.sizes() != alias.sizes() || device_tensor.strides() != alias.strides() ||
      device_tensor.storage_offset() != alias.storage_offset()) {
    impl->set_sizes_and_strides(alias.sizes(), alias.strides(), alias.storage_offset());
  }
}

// The refused-dtype rule on a result the CPU kernel made (a tensor or a list of them).
void check_result(const Call& call, const c10::IValue& value) {
  if (value.isTensor()) {
    const at::Tensor& t = value.toTensor();
    if (t.defined() && ((call.refused >> static_cast<int>(t.scalar_type())) & 1)) {
      refuse_compute(call.info.name, c10::Device(kDevice, call.device), t.scalar_type(), "its result");
    }
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) check_result(call, item);
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const OpInfo& info = op_info(op);
  const auto& schema = op.schema();
  const size_t num_args = schema.arguments().size();
  const size_t base = stack->size() - num_args;
  Call call{info, schema};
  call.refused = info.moves_data ? 0 : refused_compute_mask();
  const bool sync = info.sync.kind != Sync::kNever && reads_size(info.sync, stack->data() + base);
  c10::SmallVector<c10::IValue, 8> originals(num_args), aliases(num_args);
  for (size_t j = 0; j < num_args; ++j) {
    c10::IValue& value = (*stack)[base + j];
    c10::IValue original = value;
    if (call.lower(value, static_cast<int>(j))) {
      originals[j] = std::move(original);
      if (info.mutated[j]) aliases[j] = value;
    }
  }
  if (call.host_arg >= 0 && call.device >= 0) call.mismatch("cpu", call.host_arg);
  if (call.device < 0) call.device = current_device();
  if (call.refused_arg >= 0) {
    refuse_compute(info.name, c10::Device(kDevice, call.device), call.refused_type,
                   "argument '" + schema.arguments()[call.refused_arg].name() + "'");
  }

  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  for (size_t j = 0; j < num_args; ++j) {
    if (aliases[j].isTensor()) write_back(originals[j].toTensor(), aliases[j].toTensor());
  }
  const size_t num_returns = schema.returns().size();
  const size_t first = stack->size() - num_returns;
  for (size_t i = 0; i < num_returns; ++i) {
    c10::IValue& result = (*stack)[first + i];
    int arg = info.returns_arg[i];
    if (arg >= 0 && !originals[arg].isNone()) {
      result = originals[arg];
    } else {
      result = call.lift(result);
      if (call.refused) check_result(call, result);
    }
  }
  if (info.reads_scalar && !call.storages.empty()) count_d2h(8);
  if (sync && !call.storages.empty()) count_sync();
}

// Skip-list of ops below that must keep their composite kernel: copies (they may cross devices)
// and in-place metadata / factory ops.
bool keeps_composite(const c10::FunctionSchema& schema) {
  static const char* kKeep[] = {"aten::copy", "aten::lift_fresh_copy", "aten::as_strided_",
                                "aten::new_empty_strided"};
  for (const char* name : kKeep) {
    if (schema.operator_name().name == name) return true;
  }
  for (const auto& ret : schema.returns()) {
    if (ret.alias_info() && !ret.alias_info()->isWrite()) return true;  // a view
  }
  return false;
}

}  // namespace

int register_direct_ops() {
  // Structured ops reach a PrivateUse1 backend through a CompositeExplicitAutogradNonFunctional
  // kernel: a meta pass, an allocation, then the out= variant. Sending the functional and
  // in-place variants straight to the fallback (one CPU kernel call) halves the per-op cost.
  static auto* library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__,
                                            __LINE__);
  static int count = -1;
  if (count >= 0) return count;
  count = 0;
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = dispatcher.findOp(name);
    if (!op || !op->hasSchema() || op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1) ||
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional) ||
        keeps_composite(op->schema())) {
      continue;
    }
    std::string qualified = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
    ++count;
  }
  return count;
}

}  // namespace emulated

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace emulated;  // NOLINT
  m.impl("empty.memory_format", TORCH_FN(empty_memory_format));
  m.impl("empty_strided", TORCH_FN(empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("resize_", TORCH_FN(resize_));
  m.impl("set_.source_Storage", TORCH_FN(set_storage));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(set_storage_offset));
  m.impl("set_.source_Tensor", TORCH_FN(set_tensor));
  m.impl("set_", TORCH_FN(set_empty));
  m.impl("_copy_from", TORCH_FN(copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(copy_from_and_resize));
  m.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense));
  m.impl("record_stream", TORCH_FN(record_stream));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&emulated::fallback>());
}
