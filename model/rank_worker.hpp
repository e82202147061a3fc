#pragma once
// The training thread of a rank process. It builds the generation's c10d
// process group through the coordinator's store, takes the committed state
// from the plan's state root (broadcast over the new group), and trains
// data-parallel until train.max_steps, reporting through callbacks that the
// rank's control side turns into wire messages. No LibTorch in this header:
// the rank's actor side includes it.
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "wire.pb.h"

namespace dtactor {

struct rank_worker_callbacks {
  // Called on the training thread; must not block for long.
  std::function<void(pb::step_report)> on_step;
  std::function<void(pb::eval_report)> on_eval;           // global rank 0 only
  std::function<void(pb::checkpoint_data)> on_checkpoint;  // global rank 0 only
  // STATE_READY when the group is built and the state is in place,
  // STATE_FINISHED (detail = params digest) at train.max_steps, STATE_FAILED.
  std::function<void(pb::rank_status)> on_status;
};

struct rank_worker_options {
  std::string node_id;
  int local_rank = 0;
  int local_world = 1;          // ranks of this node (the machine's cores are split between them)
  int threads = 0;              // compute threads when train.threads = 0 (0: cores / local_world)
  std::string advertise_addr;   // this machine's address for the collectives
  std::string default_store_host;  // used when the plan names no store host
};

class rank_worker {
 public:
  rank_worker(rank_worker_options opts, rank_worker_callbacks cb);
  ~rank_worker();  // requests a stop and joins
  rank_worker(const rank_worker&) = delete;
  rank_worker& operator=(const rank_worker&) = delete;

  // Starts training in the plan's generation on a new thread. A worker runs
  // one generation; start() on a running worker is refused (returns false).
  bool start(const pb::generation_plan& plan);
  // Stop at the next step boundary.
  void request_stop() { stop_.store(true); }
  bool running() const { return running_.load(); }
  void join();

 private:
  void run(pb::generation_plan plan);
  rank_worker_options opts_;
  rank_worker_callbacks cb_;
  std::atomic<bool> stop_{false}, running_{false};
  std::thread thread_;
};

// Global rank of (node_id, local_rank) in the plan, or -1.
int global_rank_in(const pb::generation_plan& plan, const std::string& node_id, int local_rank);

}  // namespace dtactor
