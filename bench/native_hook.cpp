// native_hook.cpp: a DDP comm hook in C++ for bench/step.py's reference
// kind `stepguard-native-hook`, built by the bench against the installed
// torch with torch.utils.cpp_extension (the kind is skipped with the
// reason where that fails).
//
// It measures what stepguard's DDP would gain if its per-bucket work left
// Python: the hook starts the bucket's SUM allreduce on the c10d group the
// Manager configured for this step (zeros from a replica that does not
// participate) and divides the result by the participants in a callback on
// the group's own thread, without the GIL.  A failed collective is recorded
// and handed to the Manager before its commit vote, and the bucket is
// returned as it is, so backward never raises.
//
// Not the shipped path: the Manager's own deadline on each bucket, the
// accelerator streams and the fallbacks of python/stepguard/ddp.py are not
// here, and the module is tied to the torch it was compiled against.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// What the hook reads at each bucket (set from Python once the step's
// quorum is known) and the first failure it saw.
struct HookState {
  std::mutex mu;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int participants = 0;
  bool participating = true;
  bool failed = false;
  std::string error;

  void fail(const std::string &why) {
    std::lock_guard<std::mutex> g(mu);
    if (!failed) {
      failed = true;
      error = why;
    }
  }
};

// Divides as the Manager's _average does: by a power of two, a
// multiplication by the inverse (the same bits).
void average(const at::Tensor &t, int n) {
  if ((n & (n - 1)) == 0)
    t.mul_(1.0 / n);
  else
    t.div_(n);
}

c10::intrusive_ptr<c10::ivalue::Future> done(const at::Tensor &t) {
  auto f = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get());
  f->markCompleted(c10::IValue(t));
  return f;
}

class ManagedAllreduceHook : public c10d::CommHookInterface {
public:
  explicit ManagedAllreduceHook(std::shared_ptr<HookState> st)
      : st_(std::move(st)) {}

  c10::intrusive_ptr<c10::ivalue::Future>
  runHook(c10d::GradBucket &bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    int n;
    bool participating;
    {
      std::lock_guard<std::mutex> g(st_->mu);
      if (st_->failed || !st_->pg)
        return done(buffer); // the step already failed: leave the bucket
      pg = st_->pg;
      n = st_->participants;
      participating = st_->participating;
    }
    if (!participating)
      buffer.zero_();
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    try {
      auto st = st_;
      return pg->allreduce(tensors, opts)
          ->getFuture()
          ->then(
              [st, buffer, n](c10::ivalue::Future &f) -> c10::IValue {
                if (f.hasError())
                  st->fail(f.tryRetrieveErrorMessage());
                if (n > 0)
                  average(buffer, n);
                return c10::IValue(buffer);
              },
              c10::TensorType::get());
    } catch (const std::exception &e) {
      st_->fail(e.what());
      return done(buffer);
    }
  }

  at::Tensor parseHookResult(const c10::IValue &result) override {
    return result.toTensor();
  }

private:
  std::shared_ptr<HookState> st_;
};

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<HookState, std::shared_ptr<HookState>>(m, "HookState")
      .def(py::init<>())
      .def("set",
           [](HookState &s, c10::intrusive_ptr<c10d::ProcessGroup> pg,
              int participants, bool participating) {
             std::lock_guard<std::mutex> g(s.mu);
             s.pg = std::move(pg);
             s.participants = participants;
             s.participating = participating;
           })
      .def("take_error", [](HookState &s) -> py::object {
        std::lock_guard<std::mutex> g(s.mu);
        if (!s.failed)
          return py::none();
        s.failed = false;
        return py::str(s.error);
      });
  m.def("register", [](std::shared_ptr<c10d::Reducer> reducer,
                       std::shared_ptr<HookState> st) {
    reducer->register_comm_hook(
        std::make_unique<ManagedAllreduceHook>(std::move(st)));
  });
}
