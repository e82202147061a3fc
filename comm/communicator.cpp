#include "comm/communicator.hpp"

#include <sched.h>

#include <algorithm>
#include <condition_variable>
#include <mutex>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef DTACTOR_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace dtactor {

status wait_work(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::steady_clock::time_point deadline,
                 const std::function<bool()>& abandon, const std::string& what, std::chrono::microseconds spin) {
  if (!work) return {};
  if (spin.count() > 0) {
    const auto until = std::min(deadline, std::chrono::steady_clock::now() + spin);
    for (unsigned n = 1; !work->isCompleted(); ++n) {
      if (n % 64 == 0) {
        if (abandon && abandon()) return make_error(what + " abandoned: a newer generation replaces this one");
        if (std::chrono::steady_clock::now() >= until) break;
      }
      ::sched_yield();
    }
  }
  struct signal {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  try {
    if (!work->isCompleted()) {
      auto sig = std::make_shared<signal>();
      work->getFuture()->addCallback([sig](c10::ivalue::Future&) {
        {
          std::lock_guard<std::mutex> lock(sig->mu);
          sig->done = true;
        }
        sig->cv.notify_all();
      });
      std::unique_lock<std::mutex> lock(sig->mu);
      while (!sig->done) {
        if (abandon && abandon()) return make_error(what + " abandoned: a newer generation replaces this one");
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) return make_error(what + " timed out (cluster.collective_timeout_ms)");
        sig->cv.wait_for(lock, std::min<std::chrono::steady_clock::duration>(deadline - now, std::chrono::milliseconds(5)));
      }
    }
    work->wait();  // completed: rethrows the collective's error, if any
  } catch (const std::exception& e) {
    std::string m = e.what();
    return make_error(what + " failed: " + m.substr(0, m.find('\n')));
  }
  return {};
}

bool nccl_available() {
#ifdef DTACTOR_WITH_CUDA
  return true;
#else
  return false;
#endif
}

comm_backend resolve_backend(const communicator_options& o) {
  if (o.backend != comm_backend::automatic) return o.backend;
  return o.cuda_tensors && nccl_available() ? comm_backend::nccl : comm_backend::gloo;
}

result<c10::intrusive_ptr<c10d::ProcessGroup>> make_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                                  const communicator_options& o) {
  const comm_backend chosen = resolve_backend(o);
  const std::string backend(to_string(chosen));
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(o.name.empty() ? "g" + std::to_string(o.generation) : o.name, store);
  try {
    if (chosen == comm_backend::gloo) {
      auto opts = c10d::ProcessGroupGloo::Options::create(o.timeout);
      for (int i = 0; i < std::max(1, o.streams); ++i) opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(o.hostname));
      return c10::intrusive_ptr<c10d::ProcessGroup>(c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, rank, world, opts));
    }
    if (chosen == comm_backend::nccl) {
#ifdef DTACTOR_WITH_CUDA
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = o.timeout;
      return c10::intrusive_ptr<c10d::ProcessGroup>(c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, world, opts));
#else
      return make_error("backend 'nccl' needs a CUDA build of LibTorch with NCCL; this build has Gloo only");
#endif
    }
  } catch (const std::exception& e) {
    std::string what = e.what();
    auto nl = what.find('\n');
    return make_error(backend + " process group (rank " + std::to_string(rank) + " of " + std::to_string(world) +
                      ") could not be built: " + what.substr(0, nl));
  }
  return make_error("no communication backend resolved from '" + backend + "' (use auto, gloo or nccl)");
}

}  // namespace dtactor
