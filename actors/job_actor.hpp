#pragma once
// The coordinator's job actor (its checkpoint writer: actors/checkpoint_writer.hpp).
//
// The job actor is the one place that follows the training job: it takes
// each generation from the membership actor (plan_atom), folds the ranks'
// reports of the current generation into completed steps, evaluations and
// recovery accounting (actors/job_progress.hpp), and decides, alone, when
// the job ends: every rank FINISHED (finished at train.max_steps, stopped
// before it), a rank whose parameters differ from its peers' (failed), or a
// stop asked for by a signal (stopped after a final checkpoint, or without
// one after stop_timeout). At the end it waits for the checkpoint writer to
// have handled every checkpoint it forwarded, emits `job_ended`, has the
// membership actor send `shutdown` to every node, and answers whoever sent
// it wait_atom with (done_atom, exit_code).
//
// It reads time only through CAF's actor clock and reports only through
// the injected event sink, so tests drive it with CAF's test coordinator.
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "job/events.hpp"
#include "job/settings.hpp"
#include "actors/job_progress.hpp"
#include "actors/checkpoint_writer.hpp"
#include "actors/membership_handle.hpp"
#include "actors/messages.hpp"
#include "caf/actor.hpp"
#include "caf/behavior.hpp"
#include "caf/event_based_actor.hpp"
#include "caf/response_promise.hpp"
#include "caf/replies_to.hpp"
#include "caf/stateful_actor.hpp"
#include "caf/typed_actor.hpp"
#include "caf/typed_event_based_actor.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

struct job_options {
  int64_t max_steps = 1;     // train.max_steps
  int64_t initial_step = 0;  // committed step at start (the disk checkpoint resumed from)
  envelope_header header;
  // How long a stop waits for every rank to stop after its final checkpoint.
  clock_duration stop_timeout{std::chrono::seconds(30)};
  log_fn log;
  event_sink events;
};

inline job_options job_options_from(const train_settings& t) {
  job_options o;
  o.max_steps = t.max_steps;
  return o;
}

struct job_actor_state {
  job_options opts;
  membership_handle members;  // (members_atom, membership): shutdowns go out through it
  checkpoint_writer_handle checkpoints;  // checkpoint_written goes there (may be invalid: dropped)
  uint64_t generation = 0;
  // The generation before, when this one began by a drain (every rank of it
  // alive, switching at a step boundary): parts of a checkpoint it was still
  // storing are of the job's one line of state, and are taken.
  uint64_t drained_from = 0;
  int32_t world_size = 0;
  std::vector<plan_node> nodes;
  // Every rank of the generation has completed this many steps (the step the
  // next generation resumes from).
  int64_t committed_step = 0;
  int64_t last_step = 0;                  // highest step every rank reported
  std::map<int32_t, int64_t> rank_steps;  // global rank -> completed steps, this generation
  std::map<int64_t, int32_t> ranks_at_step;  // completed steps -> how many ranks are there (rank_steps' values counted)
  std::map<int32_t, std::string> finished_ranks;  // global rank -> its parameters' digest
  step_table steps;
  // Steps of the generation drained from that its ranks complete after the
  // plan (they finish the step they are in, and one more when the plan
  // came after their backward of that step had ended): the next generation
  // resumes from them, so they are journaled, at that generation's world
  // size. They steer nothing.
  step_table drained_steps;
  int32_t drained_world = 0;
  recovery_record recovery;
  // The generation before it: its ranks' READY may reach the coordinator
  // after the next plan (late_restore).
  recovery_record superseded;
  std::map<std::string, double> last_eval;
  int64_t last_eval_step = -1;
  // Global ranks of the current generation whose parts of the checkpoint at
  // max_steps were stored (checkpoint_written without an error).
  std::set<int32_t> final_parts;
  bool stopping = false;  // a stop was asked for: the end is a stop
  bool ending = false;    // the end is decided (job_ended follows)
  bool ended = false;     // job_ended emitted
  int exit_code = -1;     // once ended
  std::vector<caf::actor_addr> waiters;
  uint64_t stale_reports = 0;  // reports from another generation (fenced off)
  uint64_t nodes_lost = 0;
  static inline const char* name = "dtactor.job";
};

// What the job actor takes:
// (members_atom, membership): the membership actor (set once after both exist).
// (plan_atom, plan) -> int64_t committed step: a new generation (-1: the
//   job is ending, send no plan).
// inbound step_report, eval_report, rank_status, job_error of the current
//   generation, checkpoint_written of it or of the one it drained from
//   (others are counted and dropped).
// (stop_atom, reason): stop the job after a final checkpoint.
// (fail_atom, reason): the job fails with this line (nothing can go on).
// (stop_due_atom): its own timer: a stop's deadline passed.
// (wait_atom): the sender gets (done_atom, int exit_code) when the job
//   ended, as a message of its own (not a reply: it may come much later).
// (lost_atom, node_id, detected_after_s): counted and logged.
using job_handle = caf::typed_actor<caf::reacts_to<members_atom, membership_handle>, caf::replies_to<plan_atom, plan>::with<int64_t>, caf::reacts_to<inbound>,
                                    caf::reacts_to<stop_atom, std::string>, caf::reacts_to<fail_atom, std::string>, caf::reacts_to<stop_due_atom>,
                                    caf::reacts_to<wait_atom>, caf::reacts_to<lost_atom, std::string, double>>;

job_handle::behavior_type job_actor(job_handle::stateful_pointer<job_actor_state> self, job_options opts, checkpoint_writer_handle checkpoints);

}  // namespace dtactor
