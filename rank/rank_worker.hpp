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
// boundary every rank agrees on: each step's first gradient bucket carries a
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

struct shard_plan;
class training_state;


using rank_worker_callbacks = rank_work_callbacks;

struct rank_worker_options {
  std::string node_id;
  int local_rank = 0;
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
  // Waits up to `timeout` for the thread to end; false if it did not.
  bool join_for(std::chrono::milliseconds timeout);

 private:
  enum class outcome { next_plan, failed, finished, stopped, idle, quit };
  struct generation_run;  // one generation's group, state source, timeouts (rank_worker.cpp)
  void run();
  status warm_up(const pb::generation_plan& plan);
  // A generation: the group (build_group), the starting state (agree_state),
  // then the steps (train). The first two return an outcome only when it
  // ends the generation early.
  outcome run_generation(const pb::generation_plan& plan, double offered_at);
  std::optional<outcome> build_group(generation_run& g);
  std::optional<outcome> agree_state(generation_run& g);
  // agree_state's parts: the plan's checkpoint read by rank 0, ZeRO-2's
  // interrupted step, the one agreement and transfer, DiLoCo's window.
  std::optional<outcome> state_from_plan_checkpoint(generation_run& g);
  std::optional<outcome> finish_zero2_step(generation_run& g);
  std::optional<outcome> take_agreed_state(generation_run& g, bool& own_window);
  std::optional<outcome> agree_window(generation_run& g, bool own_window);
  std::optional<outcome> shard_state(generation_run& g, bool holds_current);
  std::optional<outcome> shards_from_checkpoint(generation_run& g, const shard_plan& plan, int64_t step);
  std::optional<outcome> shards_from_fallback(generation_run& g, const shard_plan& plan, const std::string& missing);
  std::optional<outcome> worker_section_from_checkpoint(generation_run& g);
  // Every checkpoint load of a generation: the plan's store and step, the
  // manifest checked, what the load planner names for this rank read.
  struct checkpoint_load;  // what to load, and what it read (rank_worker.cpp)
  std::optional<outcome> load_from_checkpoint(generation_run& g, checkpoint_load& l);
  // train.sync = diloco: the agreement on a lost worker's slices that the
  // survivors train again before the next boundary (rank_worker.cpp), and
  // whether this rank's host is one worker (train.diloco_worker = host).
  std::optional<outcome> replay_owed_slices(generation_run& g, int64_t furthest);
  bool host_worker(const generation_run& g) const;
  // The steps of a generation (train), in its parts: the exchanges chosen
  // once, the READY status, the part writer's buffer, DiLoCo's window
  // lines; then each step: a lost worker's slice replayed, the inner step,
  // DiLoCo's outer exchanges, the buffers' broadcast, the digests'
  // comparison, the step report. Each part returns an outcome only when it
  // ends the generation.
  struct steps_run;  // the generation's exchanges and step sums (rank_worker.cpp)
  outcome train(generation_run& g);
  struct step_loop;  // the loop's cadence, owed evaluation and checkpoint (rank_worker.cpp)
  std::optional<outcome> begin_steps(generation_run& g, steps_run& s);
  void set_step_control(generation_run& g, steps_run& s);
  std::optional<outcome> after_step(generation_run& g, steps_run& s, step_loop& L, int64_t attempted, int64_t window_start,
                                    std::chrono::steady_clock::time_point t0);
  void add_step_sums(steps_run& s, int64_t step, int64_t attempted);
  std::optional<outcome> at_boundary(generation_run& g, steps_run& s, step_loop& L, int64_t step, int64_t window_start);
  outcome stop_here(generation_run& g, step_loop& L, int64_t step, bool final_checkpoint);
  status choose_exchanges(generation_run& g, steps_run& s);
  void report_ready(generation_run& g, const steps_run& s);
  void prepare_part_writer(generation_run& g);
  void ensure_part_writer();
  void announce_window(generation_run& g);
  std::optional<outcome> replay_next_slice(generation_run& g, steps_run& s);
  std::optional<outcome> inner_step(generation_run& g, steps_run& s, bool replay_on);
  std::optional<outcome> outer_steps(generation_run& g, steps_run& s, int64_t max_steps, bool& boundary);
  std::optional<outcome> broadcast_buffers(generation_run& g, const steps_run& s, int64_t step);
  std::optional<outcome> compare_digests(generation_run& g, steps_run& s, int64_t step);
  void report_step(generation_run& g, steps_run& s, int64_t step);
  void fit_threads_to_host(const pb::generation_plan& plan);
  double send_eval(generation_run& g, std::map<std::string, double>& eval_at_step);  // seconds it took
  std::optional<outcome> meet_after_eval(generation_run& g, double eval_s);
  // This rank's part of a checkpoint of the current step: copied at once,
  // stored in the background (rank/part_writer).
  void write_checkpoint(generation_run& g, const std::map<std::string, double>& eval_at_step);
  // Before STATE_FINISHED: every part handed to the writer is stored.
  void finish_checkpoints();
  bool checkpoint_direct(generation_run& g, uint64_t bytes, int64_t step);
  void report_status(generation_run& g, pb::rank_status::state s, int64_t step, const std::string& detail);
  outcome failed(generation_run& g, const std::string& why, int64_t step,
                 pb::rank_status::failure_kind kind = pb::rank_status::FAILURE_UNSPECIFIED);
  // The checkpoint at `checkpoint_step` could not be loaded. `refused` (its
  // bytes do not check out, errc::corrupt_checkpoint, or it does not fit
  // the job): FAILURE_CHECKPOINT, and the coordinator marks it bad for the
  // job and plans from the previous one. Otherwise (the store unreachable,
  // an I/O error) a plain failure, which a new generation may get past.
  outcome checkpoint_unusable(generation_run& g, int64_t checkpoint_step, const std::string& why, bool refused);
  // Waits for a plan newer than `after`; false on quit.
  // Waits for a plan newer than `after` (or, with `warm_up`, any plan);
  // false on quit.
  bool take_plan(uint64_t after, bool warm_up, pb::generation_plan& out, double& offered_at);
  void inject_fault();
  // data.sample_log: the samples of the step this rank just applied (its
  // last forward_backward's); nothing when the log is off.
  // `fragments` (DiLoCo, a slice replayed to some fragments only): those.
  // `samples`: these instead of the last forward_backward's.
  status log_samples(int64_t step, uint64_t gen, int rank, int world, const std::vector<bool>& fragments = {},
                     const std::vector<int64_t>* samples = nullptr);
  bool quitting() const { return quit_.load(); }
  // True when the thread must abandon generation `gen` now: quit, or a newer
  // plan without drain is waiting.
  bool abandon(uint64_t gen) const;
  bool newer_plan_waiting(uint64_t gen) const { return offered_gen_.load() > gen; }

  struct impl;
  rank_worker_options opts_;
  rank_worker_callbacks cb_;
  std::unique_ptr<impl> impl_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<pb::generation_plan> pending_;
  bool any_offered_ = false;
  double pending_at_ = 0;                  // when it was offered (steady clock seconds)
  std::atomic<uint64_t> offered_gen_{0};   // newest generation offered
  std::atomic<uint64_t> abort_gen_{0};     // newest generation offered without drain
  std::atomic<uint64_t> running_gen_{0};   // the generation the training thread runs (0: none yet)
  std::atomic<bool> stop_{false}, stop_checkpoint_{false}, quit_{false}, done_{false};
  std::thread thread_;
};

// Global rank of (node_id, local_rank) in the plan, or -1.
int global_rank_in(const pb::generation_plan& plan, const std::string& node_id, int local_rank);

}  // namespace dtactor
