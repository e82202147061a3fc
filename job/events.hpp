#pragma once
// What the coordinator's actors tell the outside world, as typed values.
//
// Every actor of the coordinator process gets one injected `event_sink` and
// reports through it everything worth a journal line, a metric or a console
// line; the process's wiring (app/coordinator_sink.cpp) turns each event into
// those. Nothing is read back from what actors send on the wire, and no
// event is dispatched by comparing strings. Tests capture the events.
//
// The sink is called on the emitting actor's thread; several actors share
// it, so its implementation must be thread-safe (the journal and the
// Prometheus registry are).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "job/journal_events.hpp"

namespace dtactor::ev {

// One rank's step report arrived (its resource usage, read by its node).
// Not journaled: the sink's resource book writes `resources` from these.
struct rank_usage {
  int32_t global_rank = 0;
  std::string node;
  double cpu_s = 0;
  double rss_bytes = 0;
  double peak_rss_bytes = 0;  // 0: the report carried no usage
  double process_age_s = 0;
  double data_wait_s = 0;                                               // per step
  uint64_t param_bytes = 0, grad_bytes = 0, optimizer_state_bytes = 0;  // training state the rank holds (0 = not reported)
  uint64_t checkpoint_buffer_bytes = 0;  // its checkpoint part's host buffer (checkpoint.keep_buffer)
  std::optional<data_reading> data;  // sharded data (absent: the rank reads no shards)
  int64_t step = -1;                 // the step the report is for
};

// The members as the failure detector sees them, a few times a second (not
// journaled: the status page's member table).
struct member_seen {
  std::string node;
  std::string host;  // its advertised address
  int32_t node_rank = -1;
  int32_t nproc = 0;        // rank processes it runs
  int32_t ready_ranks = 0;  // of them, ready to be planned
  bool in_plan = false;     // in the current generation
  bool standby = false;     // waits outside the world as a standby node (membership's waiting_standbys)
  double heartbeat_age_s = 0;
};
struct members_view {
  uint64_t generation = 0;
  std::vector<member_seen> members;
  std::vector<std::string> draining;  // left, their ranks finishing the step in flight
};
// The job ended; emitted once, after every checkpoint it sent was handled.
// The sink journals it as job_finished, job_stopped or job_failed.
struct job_ended {
  outcome how = outcome::finished;
  int64_t step = 0;
  uint64_t generation = 0;
  int32_t world_size = 0;
  std::string params_digest;              // the ranks' (finished and stopped with every rank)
  std::map<std::string, double> metrics;  // the last evaluation
  std::string reason;                     // failed, or stopped without every rank
  bool digests_differ = false;            // ranks finished with different parameters
  bool final_checkpoint = true;           // stopped: every rank stopped after the final checkpoint
  bool resumable = true;                  // failed: starting again resumes (false: every checkpoint was refused)
  int exit_code = 0;
};

// The rest are journal events (job/journal_events.hpp).
using event =
    std::variant<node_joined, node_lost, node_left, preemption_notice, node_quarantined, job_waiting, generation_started, generation_adopted, rank_usage, step_completed, outer_step,
                 eval_done, recovery_done, checkpoint_restored, rank_down, job_error, checkpoint_saved, checkpoint_failed, checkpoint_refused, job_stopping, job_ended,
                 members_view>;

}  // namespace dtactor::ev

namespace dtactor {
using event_sink = std::function<void(const ev::event&)>;
// An actor's report through its (possibly empty) sink.
inline void emit(const event_sink& sink, ev::event e) {
  if (sink) sink(e);
}
}  // namespace dtactor
