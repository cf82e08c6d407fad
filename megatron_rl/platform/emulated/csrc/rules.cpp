// The active profile's rules (profiles.py pushes them here through set_profile): the dtypes the
// device does not compute, what the collective backend refuses; and, on every profile, which
// ops only move data and which read a data-dependent size back to the host.
// The per-op test is one load of a dtype bitmask; strings are built only for error messages.
#include "emulated.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

namespace emulated {
namespace {

std::atomic<uint64_t> g_refused{0};  // bit i: ScalarType i is not computed on the device

struct Texts {
  std::string profile = "cuda", device_name = "CUDA", fix;
};

struct CollectiveRules {
  std::unordered_map<std::string, uint64_t> accepted;  // collective -> accepted dtypes (absent: all)
  std::unordered_set<std::string> missing;             // collectives that raise
  uint64_t missing_reduce_ops = 0;                      // bit i: c10d::ReduceOp::RedOpType i raises
  std::string contiguity;                               // non-empty: non-contiguous tensors raise
};

std::mutex g_mutex;  // guards the two pointers below (written by set_profile, read per collective)
std::shared_ptr<const Texts> g_texts = std::make_shared<Texts>();
std::shared_ptr<const CollectiveRules> g_collectives = std::make_shared<CollectiveRules>();

std::shared_ptr<const Texts> texts() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_texts;
}

std::shared_ptr<const CollectiveRules> collective_rules() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_collectives;
}

uint64_t bit(c10::ScalarType type) {
  auto code = static_cast<int>(type);
  TORCH_CHECK(code >= 0 && code < 64, "emulated rules: dtype ", type, " out of the bitmask's range");
  return uint64_t{1} << code;
}

uint64_t mask_of(const std::vector<c10::ScalarType>& types) {
  uint64_t mask = 0;
  for (auto type : types) mask |= bit(type);
  return mask;
}

std::string hccl_name(c10::ScalarType type) {
  // torch_npu's kHcclDataTypeToStringMap spelling: at::kDouble, at::kByte/at::kBool, ...
  if (type == c10::kBool || type == c10::kByte) return "at::kByte/at::kBool";
  return std::string("at::k") + c10::toString(type);
}

const char* reduce_op_name(int64_t op) {
  static const char* kNames[] = {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"};
  return op >= 0 && op < 9 ? kNames[op] : "?";  // c10d::ReduceOp::RedOpType order
}

}  // namespace

uint64_t refused_compute_mask() { return g_refused.load(std::memory_order_relaxed); }

void set_compute_rules(const std::string& profile, const std::string& device_name,
                       const std::vector<c10::ScalarType>& refused, const std::string& fix) {
  auto fresh = std::make_shared<Texts>(Texts{profile, device_name, fix});
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_texts = std::move(fresh);
  }
  g_refused.store(mask_of(refused), std::memory_order_relaxed);
}

std::string device_name() { return texts()->device_name; }

void refuse_compute(const std::string& op, c10::Device device, c10::ScalarType type, const std::string& role) {
  auto t = texts();
  C10_THROW_ERROR(Error, c10::str(op, ": ", role, " is a ", c10::toString(type), " tensor on ", device, ", and the ",
                                  t->device_name, " (emulated device, ", t->profile, " profile) does not compute ",
                                  c10::toString(type), "; ", t->fix, " (megatron_rl/platform/emulated/profiles.py)"));
}

void set_collective_rules(const std::vector<std::pair<std::vector<std::string>, std::vector<c10::ScalarType>>>& groups,
                          const std::vector<std::string>& missing, const std::vector<int64_t>& missing_reduce_ops,
                          const std::string& contiguity) {
  auto rules = std::make_shared<CollectiveRules>();
  for (const auto& [names, accepted] : groups) {
    uint64_t mask = mask_of(accepted);
    for (const auto& name : names) {
      auto found = rules->accepted.find(name);
      rules->accepted[name] = found == rules->accepted.end() ? mask : (found->second & mask);
    }
  }
  rules->missing.insert(missing.begin(), missing.end());
  for (int64_t op : missing_reduce_ops) rules->missing_reduce_ops |= uint64_t{1} << op;
  rules->contiguity = contiguity;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_collectives = std::move(rules);
}

void check_collective(const char* collective, const std::vector<at::Tensor>& tensors, int64_t reduce_op) {
  auto rules = collective_rules();
  TORCH_CHECK(!rules->missing.count(collective), "ProcessGroupHCCL does not support ", collective,
              " (emulated device, npu profile: megatron_rl/platform/emulated/profiles.py)");
  TORCH_CHECK(reduce_op < 0 || !((rules->missing_reduce_ops >> reduce_op) & 1),
              "Cannot use ReduceOp.", reduce_op_name(reduce_op), " with HCCL (emulated device, npu profile) in ",
              collective);
  auto accepted = rules->accepted.find(collective);
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    TORCH_CHECK(accepted == rules->accepted.end() || (accepted->second & bit(t.scalar_type())), "HCCL ", collective,
                ": Unsupported data type ", hccl_name(t.scalar_type()),
                " (emulated device, npu profile, as torch_npu's ProcessGroupHCCL; reduce in float32 on the device "
                "or in float64 on the host)");
    TORCH_CHECK(rules->contiguity.empty() || t.is_contiguous(t.suggest_memory_format()), rules->contiguity,
                " (HCCL ", collective, ", emulated device, npu profile: call .contiguous() first)");
  }
}

// Ops that only move, cast or fill data: allowed on every dtype (views are recognised by schema).
bool moves_data_only(const std::string& name) {
  static const std::unordered_set<std::string> kMoves = {
      "aten::copy_", "aten::_to_copy", "aten::clone", "aten::fill_", "aten::zero_", "aten::empty_like",
      "aten::new_empty", "aten::new_empty_strided", "aten::empty_strided", "aten::empty", "aten::cat",
      "aten::stack", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::_unsafe_view", "aten::contiguous",
      "aten::resize_", "aten::resize_as_", "aten::set_", "aten::slice_scatter", "aten::select_scatter",
      "aten::as_strided_scatter", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::record_stream"};
  return kMoves.count(name) > 0;
}

namespace {

Sync sync_of(const std::string& name) {
  static const std::unordered_set<std::string> kAlways = {
      "aten::nonzero", "aten::_unique", "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim",
      "aten::unique_dim_consecutive", "aten::masked_select", "aten::bincount"};
  static const std::unordered_set<std::string> kIndex = {"aten::index", "aten::index_put_", "aten::index_put",
                                                         "aten::_index_put_impl_"};
  if (kAlways.count(name)) return Sync::kAlways;
  if (kIndex.count(name)) return Sync::kBoolIndices;
  if (name == "aten::repeat_interleave") return Sync::kNoOutputSize;
  return Sync::kNever;
}

// index_put_ of one host scalar through one device mask: ATen's canDispatchToMaskedFill turns it
// into masked_fill_ (no sync). Python's `x[mask] = 2.0` makes that scalar a host tensor on CUDA
// only; on other devices (torch_npu: op-plugin's masked fill then reads value.item()) it syncs.
bool masked_fill(const SyncInfo& info, const c10::IValue* args, int masks, int defined) {
  if (info.values_arg < 0 || masks != 1 || defined != 1) return false;
  const c10::IValue& values = args[info.values_arg];
  bool accumulate = info.accumulate_arg >= 0 && args[info.accumulate_arg].isBool() && args[info.accumulate_arg].toBool();
  return !accumulate && values.isTensor() && values.toTensor().is_cpu() && values.toTensor().numel() == 1;
}

}  // namespace

SyncInfo sync_info(const c10::FunctionSchema& schema) {
  SyncInfo info;
  info.kind = sync_of(schema.operator_name().name);
  const auto& args = schema.arguments();
  const char* sync_arg_name = info.kind == Sync::kBoolIndices ? "indices" : "output_size";
  for (size_t j = 0; j < args.size(); ++j) {
    const std::string& name = args[j].name();
    if (info.kind >= Sync::kBoolIndices && name == sync_arg_name) info.sync_arg = static_cast<int>(j);
    if (info.kind == Sync::kBoolIndices && name == "values") info.values_arg = static_cast<int>(j);
    if (info.kind == Sync::kBoolIndices && name == "accumulate") info.accumulate_arg = static_cast<int>(j);
  }
  return info;
}

// True when this call's output size depends on device data (`args`: the op's arguments).
bool reads_size(const SyncInfo& info, const c10::IValue* args) {
  if (info.kind == Sync::kAlways) return true;
  if (info.sync_arg < 0) return false;
  const c10::IValue& arg = args[info.sync_arg];
  if (info.kind == Sync::kNoOutputSize) return arg.isNone();
  if (!arg.isList()) return false;
  int masks = 0, defined = 0;
  for (const c10::IValue& item : arg.toListRef()) {
    if (!item.isTensor() || !item.toTensor().defined()) continue;
    const at::Tensor& t = item.toTensor();
    ++defined;
    masks += t.device().type() == kDevice && (t.scalar_type() == at::kBool || t.scalar_type() == at::kByte);
  }
  return masks > 0 && !masked_fill(info, args, masks, defined);
}

}  // namespace emulated
