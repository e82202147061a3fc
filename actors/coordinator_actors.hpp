#pragma once
// The coordinator's actors: membership/rendezvous (who is in, failure
// detection, generation plans) and job (step and generation progress, end of
// training). They read time only through CAF's actor clock (self->now(),
// delayed_send), so CAF's test coordinator drives them deterministically, and
// they send wire messages only through the injected `outbound`.
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "actors/liveness.hpp"
#include "actors/membership.hpp"
#include "actors/messages.hpp"
#include "caf/actor.hpp"
#include "caf/behavior.hpp"
#include "caf/event_based_actor.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

// A membership event for the journal (fields unused by a kind stay empty).
//   node_joined        node
//   node_lost          node, cause (heartbeat_timeout, suspected_after_collective_failure, restarted), detected_after_s
//   node_left          node, detail (the node's reason)
//   node_quarantined   node, detail (why, for how long)
//   generation_planned generation, world_size, cause, drain
//   generation_adopted generation, world_size (a restarted coordinator took over the running generation)
//   job_waiting        generation (the last one), detail (why: fewer nodes than cluster.floor_nodes)
struct cluster_event {
  std::string kind;
  std::string node;
  std::string cause;
  double detected_after_s = 0;
  uint64_t generation = 0;
  int32_t world_size = 0;
  bool drain = false;
  std::string detail;
};

struct coordinator_options {
  membership_options membership;
  liveness_options liveness;  // the tick period is liveness.heartbeat_interval
  envelope_header header;     // sender "coordinator", the job id, this process's incarnation
  std::string store_host;     // c10d store the ranks of a generation meet at
  int32_t store_port = 0;
  std::string config_toml;  // the job's effective config, sent in register_ack and plans
  // The newest checkpoint saved so far
  // (step, serialized pb::checkpoint_data; step -1 = none). A plan with no
  // surviving state holder carries it to global rank 0, which loads it
  // unless it holds newer state (every node was lost, or a coordinator
  // restarted without adopting the running generation).
  std::function<std::pair<int64_t, std::string>()> newest_checkpoint;
  log_fn log;  // one line per event worth a journal entry (may be empty)
  // Called on the actor's thread for each membership event (may be empty).
  std::function<void(const cluster_event&)> on_event;
};

template <class Config>
coordinator_options coordinator_options_from(const Config& cfg) {
  coordinator_options o;
  o.membership = membership_options_from(cfg);
  o.liveness = liveness_options_from(cfg);
  o.config_toml = cfg.to_toml();
  return o;
}

struct membership_actor_state {
  membership members;
  coordinator_options opts;
  outbound out;
  caf::actor job;                   // may be invalid: then start_step is always 0
  int64_t last_start_step = 0;      // the job actor's last answer
  std::string last_reason;          // last decision's reason (logged when it changes)
  std::vector<lost_peer> lost;      // every node declared lost, in order
  uint64_t plans_sent = 0;          // generation_plan envelopes sent
  uint64_t refused_heartbeats = 0;  // heartbeats from non-members (told to register again)
  uint64_t dropped = 0;             // inbound envelopes this actor has no use for
  uint64_t adopted = 0;             // generations taken over from the nodes
  bool stopping = false;            // stop_atom received: no more plans
  static inline const char* name = "dtactor.membership";
};

// Handles, from links::nodes: register_node (-> register_ack; its
// ready_ranks, last_generation and current_plan feed readiness and adoption),
// heartbeat (-> heartbeat_ack, or a refused register_ack telling a non-member
// to register again), leave. rank_status from a node marks its local rank
// ready (STATE_IDLE, STATE_READY) or not (STATE_EXITED), and STATE_FAILED of
// a rank of the current generation starts suspicion. Forwards step_report,
// rank_status, eval_report, checkpoint_data and job_error to `job`. On every
// tick (each heartbeat interval, starting at spawn): declares silent nodes
// lost (-> lost_atom to job; the suspect timeout while suspecting), runs
// decide(), and for a new plan asks `job` for the start step (plan_atom) and
// sends generation_plan to every node in it and every node leaving it. An
// adopted plan goes to `job` only. After (stop_atom) it plans nothing more.
caf::behavior membership_actor(caf::stateful_actor<membership_actor_state>* self, coordinator_options opts, outbound out, caf::actor job);

// Builds the wire plan: shared with tests.
pb::generation_plan to_proto(const plan& p, const coordinator_options& opts, int64_t start_step);

// The plan a node reports in register_node.current_plan: generation, world
// size, state root, drain, cause and rank slots; nodes in global rank order
// with their planned local ranks (addresses, incarnations and node ranks are
// not on the wire: adoption takes them from the registrations).
plan from_proto(const pb::generation_plan& p);

struct job_options {
  int64_t max_steps = 1;     // train.max_steps
  int64_t initial_step = 0;  // committed step at start (the disk checkpoint resumed from)
  envelope_header header;
  // Called once when the job is finished (committed step, one-line reason).
  std::function<void(int64_t step, const std::string& reason)> on_finished;
  log_fn log;
};

template <class Config>
job_options job_options_from(const Config& cfg) {
  job_options o;
  o.max_steps = cfg.get_int("train.max_steps");
  return o;
}

struct job_actor_state {
  job_options opts;
  outbound out;
  uint64_t generation = 0;
  int32_t world_size = 0;
  std::vector<plan_node> nodes;
  // Every rank of the generation has completed this many steps (the step the
  // next generation resumes from).
  int64_t committed_step = 0;
  std::map<int32_t, int64_t> rank_steps;  // global rank -> completed steps, this generation
  std::set<int32_t> finished_ranks;
  bool finished = false;
  bool stopping = false;  // stop_atom received: the end is a stop
  std::string finish_reason;
  uint64_t stale_reports = 0;  // reports from an older generation (fenced off)
  uint64_t nodes_lost = 0;
  static inline const char* name = "dtactor.job";
};

// (plan_atom, plan) -> int64_t committed step; inbound step_report and
// rank_status of the current generation (others are counted and dropped);
// (lost_atom, node_id, detected_after_s). When every rank has completed
// max_steps (or reported STATE_FINISHED) it sends shutdown to every node of
// the generation and calls on_finished. (stop_atom): the job is being
// stopped; its end is logged as a stop.
caf::behavior job_actor(caf::stateful_actor<job_actor_state>* self, job_options opts, outbound out);

}  // namespace dtactor
