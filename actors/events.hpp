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
#include <string>
#include <variant>
#include <vector>

namespace dtactor::ev {

// Why the failure detector declared a node lost.
enum class loss_cause {
  heartbeat_timeout,                   // silent for cluster.heartbeat_timeout_ms
  suspected_after_collective_failure,  // silent for the suspect timeout after a peer's collective failed
  restarted,                           // registered again as a new process (incarnation)
};
const char* to_string(loss_cause c);

struct node_joined {
  std::string node;
  std::string peer;            // the bridge's routing id of its connection
  std::string advertise_addr;  // where its ranks (and its /metrics) are reached
  int32_t metrics_port = 0;    // 0: none
};
struct node_lost {
  std::string node;
  loss_cause cause = loss_cause::heartbeat_timeout;
  double detected_after_s = 0;
};
struct node_left {
  std::string node;
  std::string reason;  // the node's own words (preemption notice, SIGTERM, ...)
};
struct node_quarantined {
  std::string node;
  std::string reason;  // why and for how long
};
// Fewer nodes than cluster.floor_nodes: no generation until more arrive.
struct job_waiting {
  uint64_t generation = 0;  // the last one
  std::string reason;
};
// A plan went out to the nodes.
struct generation_started {
  uint64_t generation = 0;
  int32_t world_size = 0;
  std::string cause;  // "start", "node_lost", "node_left", "node_joined", "rank_failed", "restart", ...
  bool drain = false;
  int64_t start_step = 0;
  int32_t state_root = -1;  // global rank whose state everyone takes (-1: each keeps its own)
  std::vector<std::string> nodes;
};
// A restarted coordinator took over the generation the nodes are running.
struct generation_adopted {
  uint64_t generation = 0;
  int32_t world_size = 0;
};
// One rank's step report arrived (its resource usage, read by its node).
struct rank_usage {
  int32_t global_rank = 0;
  std::string node;
  double cpu_s = 0;
  double rss_bytes = 0;
  double peak_rss_bytes = 0;  // 0: the report carried no usage
  double process_age_s = 0;
  double data_wait_s = 0;  // per step
};
// Every rank of the generation reported this step.
struct step_completed {
  int64_t step = 0;
  int32_t world_size = 0;
  uint64_t generation = 0;
  double loss = 0;  // sample-weighted mean over the ranks
  double lr = 0;
  int64_t samples = 0;  // over the steps the reports covered
  double samples_per_s = 0;
  double step_s = 0;  // per step (the slowest rank)
  double allreduce_s = 0;
  double allreduce_exposed_s = 0;
};
struct eval_done {
  int64_t step = 0;
  double duration_s = 0;
  std::map<std::string, double> metrics;
  std::vector<std::string> examples;
};
// The first step every rank of a generation after a failure completed.
struct recovery_done {
  uint64_t generation = 0;
  int32_t world_size = 0;
  std::string cause;
  bool drain = false;
  int64_t resumed_step = 0;
  int64_t lost_steps = 0;         // completed steps before the failure that the generation did not resume from
  double duration_s = 0;          // from the plan to that step, on the actor's clock
};
// A rank of a new generation took its state from a peer or from disk.
struct checkpoint_restored {
  int64_t step = 0;
  std::string source;  // "peer" or "disk"
  uint64_t generation = 0;
  int32_t root = 0;
  uint64_t bytes = 0;      // "peer": state bytes received
  double transfer_s = 0;   // "peer": how long that took
};
// A rank failed (its own report) or its process ended (its node's report).
struct rank_down {
  bool failed = true;  // false: the process exited
  int32_t rank = 0;
  int32_t local_rank = 0;
  std::string node;
  std::string detail;
  int32_t exit_code = 0;
  int64_t step = 0;
  uint64_t generation = 0;
};
struct node_error {
  std::string node;
  std::string message;
};
struct checkpoint_saved {
  int64_t step = 0;
  std::string path;  // the manifest
  int64_t bytes = 0;  // state bytes, all parts
  uint64_t generation = 0;
  double duration_s = 0;   // the commit
  double stall_s = 0;      // training held up at the step boundary (the slowest rank)
  double write_s = 0;      // storing the parts in the background (the slowest rank)
  double bytes_per_s = 0;  // bytes / write_s
  int32_t parts = 0;
};
struct checkpoint_failed {
  int64_t step = 0;
  std::string reason;
};
// A stop was asked for (a signal): ranks stop after a final checkpoint.
struct job_stopping {
  std::string reason;
};
enum class outcome { finished, stopped, failed };
const char* to_string(outcome o);
// The job ended; emitted once, after every checkpoint it sent was handled.
struct job_ended {
  outcome how = outcome::finished;
  int64_t step = 0;
  uint64_t generation = 0;
  int32_t world_size = 0;
  std::string params_digest;             // the ranks' (finished and stopped with every rank)
  std::map<std::string, double> metrics;  // the last evaluation
  std::string reason;                     // failed, or stopped without every rank
  bool digests_differ = false;            // ranks finished with different parameters
  bool final_checkpoint = true;           // stopped: every rank stopped after the final checkpoint
  int exit_code = 0;
};

using event = std::variant<node_joined, node_lost, node_left, node_quarantined, job_waiting, generation_started, generation_adopted, rank_usage,
                           step_completed, eval_done, recovery_done, checkpoint_restored, rank_down, node_error, checkpoint_saved, checkpoint_failed,
                           job_stopping, job_ended>;

}  // namespace dtactor::ev

namespace dtactor {
using event_sink = std::function<void(const ev::event&)>;
}  // namespace dtactor
