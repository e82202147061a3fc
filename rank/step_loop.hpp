#pragma once
// The steps of a generation, until the job ends, a stop every rank agreed
// on, a switch to a newer plan, or a failure: the exchanges chosen once,
// each step's control word, the step and its exchanges (the sync strategy's,
// rank/sync_strategy), what a synchronisation boundary does (buffers,
// digests, evaluation, checkpoint, stop, switch), the step reports and an
// injected fault.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "base/fault_mode.hpp"
#include "rank/exchange_choice.hpp"
#include "rank/outcome.hpp"
#include "rank/step_policy.hpp"
#include "rank/sync_strategy.hpp"

namespace dtactor {

struct generation_run;
struct rank_state;

// What the loop reads of the worker that runs it.
struct step_loop_options {
  // --fail-at-step/--fail-mode (rank_worker_options): -1 = off.
  int64_t fail_at_step = -1;
  fault_mode fail_mode = fault_mode::crash;
  int64_t stop_at_step = -1;                    // stop with a final checkpoint there; -1 = off
  int64_t state_checkpointed_at = -1;           // the step of the checkpoint the caller's state was read from
  std::function<bool()> newer_plan;             // a plan newer than this generation is offered
  std::function<bool()> stop, stop_checkpoint;  // a stop (with a final checkpoint) was requested
  std::function<void()> request_final_stop;     // request_stop(true)
};

// Crashes, hangs or stops this rank (and its node) as `mode` says.
void inject_fault(fault_mode mode, int64_t at_step);

class step_loop {
 public:
  step_loop(generation_run& g, rank_state& rs, step_loop_options o);
  // Runs the generation's steps; the outcome that ended them.
  generation_outcome run();

 private:
  using clock_type = std::chrono::steady_clock;
  generation_end begin();
  void report_ready();
  void finish_job_already_done();
  bool outer_pending() const;
  bool in_flight() const;
  void set_control();
  step_control control_now() const;  // this rank's control words as they stand now
  generation_end inner_step();
  generation_end after_step(int64_t attempted, int64_t window_start, clock_type::time_point t0);
  void add_step_sums(int64_t step, int64_t attempted);
  generation_end broadcast_buffers(int64_t step);
  generation_end compare_digests(int64_t step);
  void report_step(int64_t step);
  generation_end at_boundary(int64_t step, int64_t window_start);
  double send_eval();  // seconds it took
  generation_end meet_after_eval(double eval_s);
  generation_outcome stop_here(int64_t step, bool final_checkpoint);
  void write_checkpoint();
  result<std::string> digest();
  std::string whole_params_digest();
  void checkpoint_at(int64_t step);
  bool due(int64_t every, int64_t step, int64_t window_start) const;

  generation_run& g_;
  rank_state& rs_;
  training_state& state_;
  sync_strategy& sync_;
  step_loop_options o_;
  exchanges x_;

  step_in_hand h_;
  double loss_sum_steps_ = 0;  // its steps' mean losses since the last report
  int64_t loss_steps_ = 0;
  bool first_ = true;  // the first step of a generation is reported at once (recovery timing)

  step_cadence cadence_;
  std::map<std::string, double> eval_at_step_;
  // The step of the last checkpoint this generation wrote, or of the one
  // the caller's state was read from (nothing to write again there).
  int64_t last_ckpt_ = -1;
  // A rank alone (world 1: `dtactor train`, or a cluster down to one rank)
  // has nobody to agree with: every step boundary where no DiLoCo exchange
  // is in flight is a synchronisation boundary (its parameters are the
  // job's), and a stop is taken before the next step. What fell due while
  // an exchange was in flight waits for it to land.
  bool alone_ = false;
  bool eval_owed_ = false, checkpoint_owed_ = false;
  // checkpoint.defer_while_writing: the step a checkpoint fell due at while a rank still
  // stored the previous one is rs_.owed_checkpoint; `said_deferred_`: rank 0 said so.
  bool said_deferred_ = false;
};

}  // namespace dtactor
