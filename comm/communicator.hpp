#pragma once
// Builds the c10d process group of one generation: Gloo for CPU tensors,
// NCCL for CUDA tensors when dtactor is built against a CUDA LibTorch
// (DTACTOR_WITH_CUDA, set by CMake when torch_cuda and libnccl are found).
// Each generation gets its own store prefix, so groups of different
// generations never read each other's rendezvous keys.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <functional>
#include <string>

#include "dtactor/result.hpp"
#include "job/modes.hpp"

namespace dtactor {

struct communicator_options {
  comm_backend backend = comm_backend::automatic;  // cluster.backend
  bool cuda_tensors = false;               // auto picks nccl for CUDA tensors (CUDA builds only)
  std::chrono::milliseconds timeout{30000};  // each collective's own limit
  std::string hostname = "127.0.0.1";      // interface Gloo binds to (the node's advertised address)
  uint64_t generation = 0;                 // store prefix: "g<generation>/"
  std::string name;                        // store prefix instead, when not empty (another group of the same generation)
  // Gloo: connections to each peer (one device each). Collectives in
  // flight together take turns over them, so a bulk transfer issued a
  // piece at a time with `streams` in flight uses as many TCP streams.
  int streams = 1;
};

// True when this binary can use NCCL.
bool nccl_available();

// The backend the options name, `automatic` resolved: nccl for CUDA tensors
// when this build has it, else gloo. Never `automatic`.
comm_backend resolve_backend(const communicator_options& o);

// Waits for `work` until it completes, `deadline` passes, or `abandon()`
// (polled every few milliseconds; may be empty) returns true. An abandoned
// or timed-out collective may still be running inside its group: the caller
// must retire that group (keep it alive, never reuse it). Never throws; the
// error is one line naming `what`.
status wait_work(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::steady_clock::time_point deadline,
                 const std::function<bool()>& abandon, const std::string& what,
                 std::chrono::microseconds spin = std::chrono::microseconds(0));

// Blocks until all `world` ranks have joined through `store` (or the
// timeout passes). Errors are one line naming the backend and the cause.
result<c10::intrusive_ptr<c10d::ProcessGroup>> make_process_group(const c10::intrusive_ptr<c10d::Store>& store, int rank, int world,
                                                                  const communicator_options& o);

}  // namespace dtactor
