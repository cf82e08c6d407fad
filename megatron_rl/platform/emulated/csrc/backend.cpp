// The collective backend of the `emulated` device ("eccl") and the Python module.
// Each collective lowers its device tensors to zero-copy CPU aliases and hands them to an
// inner gloo backend, which then reads and writes device memory directly. It takes device
// tensors only, as NCCL / HCCL take only theirs. Under the npu profile each collective first
// passes HCCL's checks (rules.cpp): dtypes, missing collectives and reduce ops, contiguity.
#include "emulated.h"

#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

namespace emulated {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using Tensors = std::vector<at::Tensor>;

// Several inner works completed as one (the coalesced collectives run op by op).
class MultiWork final : public c10d::Work {
 public:
  MultiWork(std::vector<WorkPtr> works, c10d::OpType type) : Work(-1, type), works_(std::move(works)) {}
  bool isCompleted() override {
    for (auto& work : works_) {
      if (!work->isCompleted()) return false;
    }
    return true;
  }
  bool isSuccess() const override {
    for (const auto& work : works_) {
      if (!work->isSuccess()) return false;
    }
    return true;
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& work : works_) work->wait(timeout);
    return true;
  }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(c10::FutureType::create(c10::AnyType::get()));
    for (auto& work : works_) futures.push_back(work->getFuture());
    return c10::collectAll(futures);
  }

 private:
  std::vector<WorkPtr> works_;
};

Tensors lower(const Tensors& tensors, const char* collective) {
  Tensors out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().type() == kDevice, "eccl ", collective, ": got a tensor on ", t.device(),
                "; eccl (like NCCL / HCCL) takes emulated device tensors only");
    out.push_back(cpu_alias(t));
  }
  return out;
}

std::vector<Tensors> lower(const std::vector<Tensors>& lists, const char* collective) {
  std::vector<Tensors> out;
  out.reserve(lists.size());
  for (const auto& list : lists) out.push_back(lower(list, collective));
  return out;
}

at::Tensor lower(const at::Tensor& t, const char* collective) { return lower(Tensors{t}, collective)[0]; }

Tensors flat(const std::vector<Tensors>& lists) {
  Tensors out;
  for (const auto& list : lists) out.insert(out.end(), list.begin(), list.end());
  return out;
}

int64_t op_of(const c10d::ReduceOp& op) { return static_cast<int64_t>(op.op_); }

class CollectiveBackend final : public c10d::Backend {
 public:
  explicit CollectiveBackend(c10::intrusive_ptr<c10d::Backend> inner)
      : Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)) {}

  const std::string getBackendName() const override { return "eccl"; }

  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    check_collective("broadcast", tensors, -1);
    auto host = lower(tensors, "broadcast");
    return inner_->broadcast(host, opts);
  }
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    check_collective("allreduce", tensors, op_of(opts.reduceOp));
    auto host = lower(tensors, "allreduce");
    return inner_->allreduce(host, opts);
  }
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    check_collective("allreduce_coalesced", tensors, op_of(opts.reduceOp));
    std::vector<WorkPtr> works;
    for (auto& t : tensors) {
      c10d::AllreduceOptions one;
      one.reduceOp = opts.reduceOp;
      one.timeout = opts.timeout;
      auto host = lower(Tensors{t}, "allreduce_coalesced");
      works.push_back(inner_->allreduce(host, one));
    }
    return c10::make_intrusive<MultiWork>(std::move(works), c10d::OpType::ALLREDUCE_COALESCED);
  }
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    check_collective("reduce", tensors, op_of(opts.reduceOp));
    auto host = lower(tensors, "reduce");
    return inner_->reduce(host, opts);
  }
  WorkPtr allgather(std::vector<Tensors>& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    check_collective("allgather", inputs, -1);
    check_collective("allgather", flat(outputs), -1);
    auto out = lower(outputs, "allgather");
    auto in = lower(inputs, "allgather");
    return inner_->allgather(out, in, opts);
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    check_collective("_allgather_base", {output, input}, -1);
    auto out = lower(output, "all_gather_into_tensor");
    auto in = lower(input, "all_gather_into_tensor");
    return inner_->_allgather_base(out, in, opts);
  }
  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    check_collective("allgather_into_tensor_coalesced", inputs, -1);
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < outputs.size(); ++i) works.push_back(_allgather_base(outputs[i], inputs[i], opts));
    return c10::make_intrusive<MultiWork>(std::move(works), c10d::OpType::COALESCED);
  }
  WorkPtr gather(std::vector<Tensors>& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override {
    check_collective("gather", inputs, -1);
    auto out = lower(outputs, "gather");
    auto in = lower(inputs, "gather");
    return inner_->gather(out, in, opts);
  }
  WorkPtr scatter(Tensors& outputs, std::vector<Tensors>& inputs, const c10d::ScatterOptions& opts) override {
    check_collective("scatter", outputs, -1);
    check_collective("scatter", flat(inputs), -1);
    auto out = lower(outputs, "scatter");
    auto in = lower(inputs, "scatter");
    return inner_->scatter(out, in, opts);
  }
  WorkPtr reduce_scatter(Tensors& outputs, std::vector<Tensors>& inputs,
                         const c10d::ReduceScatterOptions& opts) override {
    check_collective("reduce_scatter", outputs, op_of(opts.reduceOp));
    check_collective("reduce_scatter", flat(inputs), op_of(opts.reduceOp));
    auto out = lower(outputs, "reduce_scatter");
    auto in = lower(inputs, "reduce_scatter");
    return inner_->reduce_scatter(out, in, opts);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                               const c10d::ReduceScatterOptions& opts) override {
    check_collective("_reduce_scatter_base", {output, input}, op_of(opts.reduceOp));
    auto out = lower(output, "reduce_scatter_tensor");
    auto in = lower(input, "reduce_scatter_tensor");
    return inner_->_reduce_scatter_base(out, in, opts);
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    check_collective("reduce_scatter_tensor_coalesced", inputs, op_of(opts.reduceOp));
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < outputs.size(); ++i) works.push_back(_reduce_scatter_base(outputs[i], inputs[i], opts));
    return c10::make_intrusive<MultiWork>(std::move(works), c10d::OpType::COALESCED);
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    check_collective("alltoall_base", {output, input}, -1);
    auto out = lower(output, "all_to_all_single");
    auto in = lower(input, "all_to_all_single");
    return inner_->alltoall_base(out, in, output_splits, input_splits, opts);
  }
  WorkPtr alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override {
    check_collective("alltoall", outputs, -1);
    check_collective("alltoall", inputs, -1);
    auto out = lower(outputs, "all_to_all");
    auto in = lower(inputs, "all_to_all");
    return inner_->alltoall(out, in, opts);
  }
  WorkPtr send(Tensors& tensors, int dst, int tag) override {
    check_collective("send", tensors, -1);
    auto host = lower(tensors, "send");
    return inner_->send(host, dst, tag);
  }
  WorkPtr recv(Tensors& tensors, int src, int tag) override {
    check_collective("recv", tensors, -1);
    auto host = lower(tensors, "recv");
    return inner_->recv(host, src, tag);
  }
  WorkPtr recvAnysource(Tensors& tensors, int tag) override {
    check_collective("recvAnysource", tensors, -1);
    auto host = lower(tensors, "recv");
    return inner_->recvAnysource(host, tag);
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override { return inner_->barrier(opts); }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner_->getSequenceNumberForGroup(); }
  void setTimeout(std::chrono::milliseconds timeout) override { inner_->setTimeout(timeout); }
  void abort() override { inner_->abort(); }
  void shutdown() override { inner_->shutdown(); }

 private:
  c10::intrusive_ptr<c10d::Backend> inner_;
};

}  // namespace
}  // namespace emulated

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace emulated;  // NOLINT
  py::module_::import("torch._C._distributed_c10d");  // registers c10d::Backend, our base class
  py::class_<CollectiveBackend, c10d::Backend, c10::intrusive_ptr<CollectiveBackend>>(m, "CollectiveBackend")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>>(), py::arg("inner"));
  m.def("device_count", [] { return static_cast<int>(device_count()); });
  m.def("current_device", [] { return static_cast<int>(current_device()); });
  m.def("set_device", [](int index) { set_device(static_cast<c10::DeviceIndex>(index)); });
  m.def("memory_allocated", [](int index) { return memory_allocated(static_cast<c10::DeviceIndex>(index)); });
  m.def("max_memory_allocated", [](int index) { return max_memory_allocated(static_cast<c10::DeviceIndex>(index)); });
  m.def("reset_peak_memory", [](int index) { reset_peak_memory(static_cast<c10::DeviceIndex>(index)); });
  m.def("transfer_counts", [] {
    Transfers t = transfers();
    return py::make_tuple(t.h2d, t.d2h, t.h2d_bytes, t.d2h_bytes, t.syncs);
  });
  m.def("reset_transfer_counts", &reset_transfers);
  m.def("register_direct_ops", &register_direct_ops);
  m.def("set_compute_rules", &set_compute_rules, py::arg("profile"), py::arg("device_name"), py::arg("refused"),
        py::arg("fix"));
  m.def("set_collective_rules", &set_collective_rules, py::arg("groups"), py::arg("missing"),
        py::arg("missing_reduce_ops"), py::arg("contiguity"));
  m.def("set_memory_capacity", &set_memory_capacity, py::arg("bytes"));
  m.def("memory_capacity", &memory_capacity);
  m.def("mem_get_info", [](int index) {
    int64_t total = total_memory();
    int64_t used = memory_allocated(static_cast<c10::DeviceIndex>(index));
    return py::make_tuple(std::max<int64_t>(total - used, 0), total);
  });
}
