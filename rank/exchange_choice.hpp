#pragma once
// How a generation's gradients (with ZeRO, parameters; with DiLoCo,
// pseudo-gradients) travel: the reducers chosen once per generation from
// the config and the group's exchange plan, and the line the rank's READY
// status says about them.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/grad_sync.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct generation_run;
struct gate_slot;
class unit_gatherer;
struct rank_state;

struct exchanges {
  grad_sync_options options;
  // One reducer, or one a streaming DiLoCo fragment (their exchanges take
  // turns on the same transport, one in flight at a time).
  std::vector<std::unique_ptr<grad_sync>> syncs;
  // train.diloco_worker = host: the host's per-step reducer (it takes turns
  // with the outer exchange on the host's segment), or why there is none.
  std::unique_ptr<grad_sync> host_sync;
  std::string host_workers_why_not;
  bool zero2 = false;  // gradients reduce-scattered into the optimizer's windows
  bool streaming = false, fragments_off_shm = false;
  // Buffers training changes (BatchNorm): rank 0's go to every rank after
  // each step (PyTorch DDP's broadcast_buffers), or the ranks' states drift
  // apart and the digest comparison stops the job.
  std::vector<torch::Tensor> moving_buffers;

  // train.zero = 3: the units' gate and the slots it is installed in
  // (cleared when the generation's exchanges go).
  std::shared_ptr<unit_gatherer> gate;
  std::vector<gate_slot*> gated;

  exchanges() = default;
  exchanges(const exchanges&) = delete;
  exchanges& operator=(const exchanges&) = delete;
  ~exchanges();

  grad_sync& sync() const { return *syncs.front(); }
  // The reducers' bucket buffers kept between steps.
  int64_t buffer_bytes() const;
};

// The generation's reducers (into an empty `x`); an error is the config's.
status choose_exchanges(const generation_run& g, rank_state& rs, exchanges& x);

// What the READY status and stderr say about the transport.
std::string describe_transport(const generation_run& g, const exchanges& x, rank_state& rs);

}  // namespace dtactor
