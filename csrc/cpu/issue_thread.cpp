// The CPU counterpart of CUDA's all-gather stream: one thread that copies a unit's shard into its
// gathered buffer and issues the broadcasts that gather the other ranks' shards, in the order the
// unit hooks submitted them.
//
// Issuing from the compute thread costs it the copy-in (a memory-bound pass over the shard: about
// 0.2 ms for a 2 MiB shard here) and one Python-level collective call per rank, for every unit;
// that time is spent before the unit's compute starts, so no prefetch can hide it. A Python helper
// thread would move the work but not the cost: its Python code and the compute thread's hooks
// take turns on the GIL.
//
// A job's tensors are released by the thread that waits on it, with the GIL held: dropping a
// reference to a tensor Python also holds can take the GIL, which this thread should not need.
// Only a job dropped unwaited (an error path) is freed here, taking the GIL then; exit drains
// the queue before the interpreter finalizes, so that happens before.
//
// Collectives of one process group must be issued in the same order on every member. Everything
// submitted here goes to process groups that only this thread uses (see
// fsdp_ext/runtime/comm/collectives.py:issue_thread_group), and one thread keeps the submission order, which the
// unit schedule makes the same on every rank. Nothing here waits for a peer: broadcasts are
// asynchronous, and the caller waits on the returned work handles.
#include "../issue_thread.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <omp.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace fsdp_ext {
namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

// One unit's all-gather: what to copy where, and, once issued, the work handles (or the error).
class GatherJob {
 public:
  GatherJob(std::vector<at::Tensor> fulls, std::vector<at::Tensor> sources, int64_t slot,
            std::optional<GroupPtr> group, int threads)
      : fulls_(std::move(fulls)), sources_(std::move(sources)), slot_(slot),
        group_(std::move(group)), threads_(threads) {}

  void run() {
    std::vector<WorkPtr> works;
    std::string error;
    try {
      works = issue();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      works_ = std::move(works);
      error_ = std::move(error);
      done_ = true;
    }
    cv_.notify_all();
  }

  // Blocks (without the GIL) until issued and every broadcast finished; raises what issuing or
  // a broadcast raised (a peer that died, or `timeout_s` passed).
  void wait(std::optional<double> timeout_s) {
    {
      pybind11::gil_scoped_release no_gil;
      wait_works(timeout_s);
    }
    // Here, with the GIL: dropping a reference to a tensor that Python also holds can need it.
    fulls_.clear();
    sources_.clear();
  }

 private:
  void wait_works(std::optional<double> timeout_s) {
    const auto start = std::chrono::steady_clock::now();
    const auto bound = std::chrono::duration<double>(timeout_s.value_or(0.0));
    std::vector<WorkPtr> works;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (timeout_s) {
        TORCH_CHECK(cv_.wait_for(lock, bound, [this] { return done_; }),
                    "the all-gather was not issued within ", *timeout_s, " s");
      } else {
        cv_.wait(lock, [this] { return done_; });
      }
      TORCH_CHECK(error_.empty(), error_);
      works = std::move(works_);
      works_.clear();
    }
    for (const WorkPtr& work : works) {
      if (!timeout_s) {
        work->wait();
        continue;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          bound - (std::chrono::steady_clock::now() - start));
      work->wait(std::max(left, std::chrono::milliseconds(1)));
    }
  }

  std::vector<WorkPtr> issue() {
    at::ThreadLocalStateGuard state_guard(state_);
    // The copy-in's parallel loops use as many threads as the submitting thread would have.
    if (omp_get_max_threads() != threads_) omp_set_num_threads(threads_);
    static auto cast_into_slot =
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("fsdp_ext::cast_into_slot", "")
            .typed<void(const at::Tensor&, const at::Tensor&, int64_t)>();
    at::NoGradGuard no_grad;
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < fulls_.size(); ++i) {
      const at::Tensor& full = fulls_[i];    // [W * n]
      const at::Tensor& source = sources_[i];  // [n]
      if (full.numel() == 0) continue;         // nothing to copy or gather (on every rank)
      // A wire format that writes its own bytes (quantized, tensor subclass) filled its slot
      // already: the source is that slot.
      // (a bad slot or size is cast_into_slot's to report)
      const int64_t n = source.numel();
      const bool in_slot = n > 0 && (slot_ + 1) * n <= full.numel() &&
                           source.scalar_type() == full.scalar_type() &&
                           source.data_ptr() == full.narrow(0, slot_ * n, 1).data_ptr();
      if (!in_slot) cast_into_slot.call(source, full, slot_);
      if (!group_) continue;
      const GroupPtr& group = *group_;
      const int64_t world = group->getSize();
      const int64_t chunk = full.numel() / world;
      for (int64_t r = 0; r < world; ++r) {  // one broadcast per rank, in place: see runtime/comm/collectives.py
        std::vector<at::Tensor> tensors{full.narrow(0, r * chunk, chunk)};
        c10d::BroadcastOptions options;
        options.rootRank = r;
        options.rootTensor = 0;
        works.push_back(group->broadcast(tensors, options));
      }
    }
    return works;
  }

  std::vector<at::Tensor> fulls_, sources_;
  int64_t slot_;
  std::optional<GroupPtr> group_;
  int threads_;
  // The submitting thread's state, made at construction (an active profiler then records the
  // copy-in and the broadcasts on this thread, as it does on autograd's worker threads).
  at::ThreadLocalState state_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::vector<WorkPtr> works_;
  std::string error_;
};

class IssueThread {
 public:
  IssueThread() : thread_([this] { loop(); }) {}

  void submit(std::shared_ptr<GatherJob> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(job));
      ++pending_;
    }
    cv_.notify_one();
  }

  // Returns once everything submitted so far was issued (used at exit).
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [this] { return pending_ == 0; });
  }

  pid_t pid() const { return pid_; }

 private:
  void loop() {
    for (;;) {
      std::shared_ptr<GatherJob> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      job->run();
      job.reset();  // before the count drops: drain() then covers freeing an unwaited job
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      idle_.notify_all();
    }
  }

  pid_t pid_ = getpid();
  std::mutex mutex_;
  std::condition_variable cv_, idle_;
  std::deque<std::shared_ptr<GatherJob>> queue_;
  size_t pending_ = 0;
  std::thread thread_;
};

IssueThread& issue_thread() {
  // Never destroyed (the thread runs until the process ends: joining it from a static destructor
  // could wait on a process group torch already tore down); a forked child starts its own.
  static std::mutex mutex;
  static IssueThread* instance = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (instance == nullptr || instance->pid() != getpid()) instance = new IssueThread();
  return *instance;
}

}  // namespace

void register_issue_thread(pybind11::module_& module) {
  pybind11::class_<GatherJob, std::shared_ptr<GatherJob>>(module, "_IssuedGather")
      .def("wait", &GatherJob::wait, pybind11::arg("timeout_s") = pybind11::none(),
           "Block until issued and gathered.");
  module.def(
      "issue_all_gather",
      [](std::vector<at::Tensor> fulls, std::vector<at::Tensor> sources, int64_t slot,
         std::optional<GroupPtr> group) {
        TORCH_CHECK(fulls.size() == sources.size(), "issue_all_gather: ", fulls.size(),
                    " gathered buffers but ", sources.size(), " sources");
        for (const auto& full : fulls) {
          TORCH_CHECK(full.device().is_cpu() && full.is_contiguous() && full.dim() == 1,
                      "issue_all_gather: gathered buffers must be flat contiguous CPU tensors");
        }
        auto job = std::make_shared<GatherJob>(std::move(fulls), std::move(sources), slot,
                                               std::move(group), omp_get_max_threads());
        issue_thread().submit(job);
        return job;
      },
      pybind11::arg("fulls"), pybind11::arg("sources"), pybind11::arg("slot"),
      pybind11::arg("group"),
      "Queue the copy of `sources` into slot `slot` of `fulls` and the broadcasts that gather the "
      "other slots over `group` (None: copy only) on the issue thread.");
  module.def(
      "drain_issue_thread",
      [] {
        pybind11::gil_scoped_release no_gil;
        issue_thread().drain();
      },
      "Return once everything submitted to the issue thread was issued.");
}

}  // namespace fsdp_ext
