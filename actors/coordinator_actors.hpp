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

struct coordinator_options {
  membership_options membership;
  liveness_options liveness;  // the tick period is liveness.heartbeat_interval
  envelope_header header;     // sender "coordinator", the job id, this process's incarnation
  std::string store_host;     // c10d store the ranks of a generation meet at
  int32_t store_port = 0;
  std::string config_toml;  // the job's effective config, sent in register_ack and plans
  // The newest valid disk checkpoint (a serialized pb::checkpoint_data) and
  // its step, when the job resumes from disk: a plan with no live state
  // source that starts at resume_step carries it to global rank 0, which
  // broadcasts it over the new communicator.
  std::string resume_checkpoint;
  int64_t resume_step = -1;
  // Until ranks can change generation mid-run (fault handling), a running
  // job keeps the nodes it started with: other nodes are refused.
  bool fixed_world_after_start = false;
  log_fn log;               // one line per event worth a journal entry (may be empty)
};

template <class Config>
coordinator_options coordinator_options_from(const Config& cfg) {
  coordinator_options o;
  o.membership = membership_options_from(cfg);
  o.liveness.heartbeat_interval = std::chrono::milliseconds(cfg.get_int("cluster.heartbeat_interval_ms"));
  o.liveness.heartbeat_timeout = std::chrono::milliseconds(cfg.get_int("cluster.heartbeat_timeout_ms"));
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
  static inline const char* name = "dtactor.membership";
};

// Handles, from links::nodes: register_node (-> register_ack), heartbeat (->
// heartbeat_ack, or a refused register_ack telling a non-member to register
// again), leave. Forwards step_report, rank_status, eval_report,
// checkpoint_data and job_error to `job`. On every tick (each heartbeat
// interval, starting at spawn): declares silent nodes lost (-> lost_atom to
// job), runs decide(), and for a new plan asks `job` for the start step
// (plan_atom) and sends generation_plan to every node in it.
caf::behavior membership_actor(caf::stateful_actor<membership_actor_state>* self, coordinator_options opts, outbound out, caf::actor job);

// Builds the wire plan (without start_step/config): shared with tests.
pb::generation_plan to_proto(const plan& p, const coordinator_options& opts, int64_t start_step);

struct job_options {
  int64_t max_steps = 1;  // train.max_steps
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
  std::string finish_reason;
  uint64_t stale_reports = 0;  // reports from an older generation (fenced off)
  uint64_t nodes_lost = 0;
  static inline const char* name = "dtactor.job";
};

// (plan_atom, plan) -> int64_t committed step; inbound step_report and
// rank_status of the current generation (others are counted and dropped);
// (lost_atom, node_id, detected_after_s). When every rank has completed
// max_steps (or reported STATE_FINISHED) it sends shutdown to every node of
// the generation and calls on_finished.
caf::behavior job_actor(caf::stateful_actor<job_actor_state>* self, job_options opts, outbound out);

}  // namespace dtactor
