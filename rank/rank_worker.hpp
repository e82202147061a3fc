#pragma once
// The training thread of a rank process. It lives as long as the process and
// moves from generation to generation without restarting:
//
//   warm-up plan (generation 0: the job's config) -> load model and data,
//   report STATE_IDLE; then for each generation it is given:
//   build the generation's c10d group through the coordinator's store (a
//   newer plan abandons the build), agree in-band on the newest state any
//   member holds (max step; lowest rank holding it is the root) and take it
//   from that peer, report STATE_READY, train until the job ends, a stop, a
//   failure, or a switch to the next generation.
//
// Switching. A plan with `drain` (nobody was lost) is taken at a step
// boundary every rank agrees on: each step's last gradient bucket carries a
// control word, SUM-reduced with it, of "I hold a newer plan" and "stop
// requested"; when every rank holds the newer plan, all switch after the
// same step. A plan
// without `drain` (someone was lost) abandons whatever collective the thread
// is blocked in at once; the partial step is dropped (gradients zeroed, the
// optimizer never stepped), and the old group is parked, never destroyed.
//
// No completed step is lost: a rank whose allreduce finished applied the
// global-batch gradient, so its state is the true state after that step; the
// agreement picks the highest step any survivor holds, and nothing applied is
// ever undone.
//
// It is the `rank_work` (actors/rank_work.hpp) the rank actor drives. No
// LibTorch in this header.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "base/fault_mode.hpp"
#include "dtactor/result.hpp"
#include "base/job_key.hpp"

#include "actors/rank_work.hpp"
#include "wire.pb.h"

namespace dtactor {

class training_state;
struct rank_state;
struct step_loop_options;
class checkpoint_saver;
class sync_strategy;
struct job_settings;
// How a generation ends (rank/outcome.hpp).
enum class generation_outcome : int;


using rank_worker_callbacks = rank_work_callbacks;

struct rank_worker_options {
  std::string node_id;
  int local_rank = 0;              // -1: a warm spare, until take_slot
  int local_world = 1;             // ranks of this node (the machine's cores are split between them)
  int threads = 0;                 // compute threads when train.threads = 0 (0: cores / local_world)
  std::string advertise_addr;      // this machine's address for the collectives
  std::string default_store_host;  // used when the plan names no store host
  std::shared_ptr<const job_key> key;  // the job key: the rendezvous store is CURVE (docs/security.md)
  // Fault injection for tests (--fail-at-step/--fail-mode on a node): right
  // after the first step it completes at or after `fail_at_step` this rank crashes its node (kill -9
  // of the node agent and itself), hangs it (SIGSTOP), makes it leave
  // (SIGTERM), or crashes itself only (rank_crash). -1: off.
  int64_t fail_at_step = -1;
  fault_mode fail_mode = fault_mode::crash;
  // glibc's mmap threshold while the training state is built, and after
  // (0: left alone). A low one at set-up gives the module's own parameter
  // tensors a mapping each, so that those the optimizer's flat buffers
  // replace go back to the kernel as they are freed (app/rank.cpp).
  int setup_mmap_threshold = 0, step_mmap_threshold = 0;
  // The training state to start from, made (and maybe loaded from a
  // checkpoint) by the caller: `dtactor train` runs this worker at world 1
  // on the state it resumed. Null: the worker makes it from the first plan.
  std::shared_ptr<training_state> state;
  // Stop, with a final checkpoint, once this many steps are completed (as
  // request_stop(true) then, at the same step on every rank); -1 = off.
  int64_t stop_at_step = -1;
  // The step of the committed checkpoint `state` was read from (-1: none):
  // not written again when the worker starts or stops there.
  int64_t state_checkpointed_at = -1;
  // The warm-up's STATE_IDLE carries the digests of the job's data files,
  // for a coordinator to compare across nodes (off with nobody to compare).
  bool data_digests = true;
};

class rank_worker : public rank_work {
 public:
  rank_worker(rank_worker_options opts, rank_worker_callbacks cb);
  ~rank_worker() override;  // quit() and join
  rank_worker(const rank_worker&) = delete;
  rank_worker& operator=(const rank_worker&) = delete;

  // Hands over a plan; never blocks. Only plans newer than every plan offered
  // before are kept (false otherwise). The first plan may be a warm-up plan
  // (generation 0).
  bool offer(const pb::generation_plan& plan) override;
  // Stops at a step boundary all ranks agree on; with `checkpoint`, every
  // rank first stores its part of a final checkpoint. Then STATE_FINISHED.
  void request_stop(bool checkpoint) override;
  // Leaves at once: abandons any collective, the thread ends.
  void quit() override;
  // A warm spare becomes local rank `local_rank` (before any plan naming
  // it): it says its warm-up's STATE_IDLE again as that rank (with the data
  // digests, for the coordinator), and its first READY there carries
  // from_spare.
  void take_slot(int32_t local_rank) override;
  // Waits up to `timeout` for the thread to end; false if it did not.
  bool join_for(std::chrono::milliseconds timeout);

 private:
  using outcome = generation_outcome;
  void run();
  status warm_up(const pb::generation_plan& plan);
  // A generation: the group (rank/group_builder), the starting state
  // (rank/state_source), then the steps (rank/step_loop).
  // drain_s: from the plan's arrival to the previous generation's end.
  outcome run_generation(const pb::generation_plan& plan, double offered_at, double drain_s);
  void fit_threads_to_host(const pb::generation_plan& plan);
  step_loop_options loop_options(uint64_t gen);  // what the step loop reads of this worker
  std::unique_ptr<checkpoint_saver> make_saver(const job_settings& s, const sync_strategy& sync);
  // Waits for a plan newer than `after` (or, with `warm_up`, any plan);
  // false on quit.
  bool take_plan(uint64_t after, bool warm_up, pb::generation_plan& out, double& offered_at);
  bool quitting() const { return quit_.load(); }
  // True when the thread must abandon generation `gen` now: quit, or a newer
  // plan without drain is waiting.
  bool abandon(uint64_t gen) const;
  bool newer_plan_waiting(uint64_t gen) const { return offered_gen_.load() > gen; }
  int local_rank() const;  // opts_.local_rank, which take_slot sets once
  // The sample log (data.sample_log) under this rank's name: at the
  // warm-up, or for a spare once it has a slot.
  status open_sample_log();
  // The callbacks of a generation: a spare's first READY in its slot says
  // it was one.
  rank_worker_callbacks generation_callbacks();

  rank_worker_options opts_;
  rank_worker_callbacks cb_;
  std::unique_ptr<rank_state> impl_;  // what the thread keeps across generations (rank/generation.hpp)

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<pb::generation_plan> pending_;
  bool any_offered_ = false;
  double pending_at_ = 0;                  // when it was offered (steady clock seconds)
  std::atomic<uint64_t> offered_gen_{0};   // newest generation offered
  std::atomic<uint64_t> abort_gen_{0};     // newest generation offered without drain
  std::atomic<uint64_t> running_gen_{0};   // the generation the training thread runs (0: none yet)
  std::atomic<bool> stop_{false}, stop_checkpoint_{false}, quit_{false}, done_{false};
  bool from_spare_ = false;  // took a slot as a spare and has not reported READY in it yet (mu_)
  std::optional<pb::rank_status> warmed_up_;  // the warm-up's STATE_IDLE, said again as the slot's rank (mu_)
  std::thread thread_;
};

// Global rank of (node_id, local_rank) in the plan, or -1.
int global_rank_in(const pb::generation_plan& plan, const std::string& node_id, int local_rank);

}  // namespace dtactor
