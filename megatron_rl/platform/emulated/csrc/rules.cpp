// The active profile's rules (profiles.py pushes them here through set_profile): the dtypes the
// device does not compute, what the collective backend refuses, and which ops are host syncs.
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

}  // namespace emulated
