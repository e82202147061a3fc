#pragma once
// The coordinator's membership/rendezvous actor (who is in, failure
// detection, generation plans); the job actor and the checkpoint writer are
// in actors/job_actor.hpp. They read time only through CAF's actor clock (self->now(),
// delayed_send), so CAF's test coordinator drives them deterministically, and
// they send wire messages only through the injected `outbound`.
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "actors/checkpoint_choice.hpp"
#include "job/events.hpp"
#include "actors/job_actor.hpp"
#include "actors/liveness.hpp"
#include "actors/membership.hpp"
#include "actors/membership_handle.hpp"
#include "actors/relays.hpp"
#include "actors/messages.hpp"
#include "caf/actor.hpp"
#include "caf/behavior.hpp"
#include "caf/event_based_actor.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

struct coordinator_options {
  membership_options membership;
  liveness_options liveness;  // the tick period is liveness.heartbeat_interval
  relay_options relays;       // cluster.relay_group_size / relay_from_nodes (actors/relays.hpp)
  envelope_header header;     // sender "coordinator", the job id, this process's incarnation
  std::string store_host;     // c10d store the ranks of a generation meet at
  int32_t store_port = 0;
  std::string config_toml;  // the job's effective config, sent in register_ack and plans
  // Where the ranks write checkpoint parts and load checkpoints from (an
  // absolute directory, a shared mount, or s3://...), sent in every plan.
  std::string checkpoint_store;
  // A torchscript job's module file, put into the checkpoint store by the
  // coordinator ("module-<xxh3>.pt", and its "<size>:<xxh3 hex>"), sent in
  // register_ack: a node needs no copy of its own.
  std::string module_object, module_digest;
  // The committed checkpoints at start: the one resumed from and those
  // before it (ledger_at_start; empty: none, or starting over); newer ones
  // arrive as (ckpt_atom, step, kept). A plan with no surviving state
  // holder names the newest that no rank refused (actors/checkpoint_choice.hpp);
  // global rank 0 loads it from the store unless it holds newer state
  // (every node was lost, or a coordinator restarted without adopting the
  // running generation).
  checkpoint_ledger checkpoints;
  // The job's data files as the coordinator sees them (path -> digest,
  // job/job_config.hpp data_file_digests); a node whose ranks opened
  // different ones is refused. Files missing here take the first node's.
  std::map<std::string, std::string> data_digests;
  // Called once (then nothing more is decided here) when every member was
  // lost to silence and no node has been heard from for orphan_after:
  // this coordinator is cut off from the nodes. Empty: never (a
  // coordinator without a standby waits for them).
  std::function<void(const std::string&)> orphaned;
  std::chrono::milliseconds orphan_after{0};
  log_fn log;         // one line per event worth a journal entry (may be empty)
  event_sink events;  // node_joined, node_lost, node_left, node_quarantined, job_waiting, generation_started, generation_adopted
};

// The options the cluster.* settings set; `config_toml`: the effective
// config, as every plan carries it.
inline coordinator_options coordinator_options_from(const cluster_settings& c, std::string config_toml) {
  coordinator_options o;
  o.membership = membership_options_from(c);
  o.liveness = liveness_options_from(c);
  o.relays = relay_options_from(c);
  o.config_toml = std::move(config_toml);
  return o;
}

struct membership_actor_state {
  membership members;
  coordinator_options opts;
  outbound out;
  job_handle job;                   // may be invalid: then start_step is always 0
  int64_t last_start_step = 0;      // the job actor's last answer
  std::string last_reason;          // last decision's reason (logged when it changes)
  std::vector<lost_node> lost;      // every node declared lost, in order
  uint64_t plans_sent = 0;          // generation_plan envelopes sent
  uint64_t refused_heartbeats = 0;  // heartbeats from non-members (told to register again)
  uint64_t dropped = 0;             // inbound envelopes this actor has no use for
  uint64_t adopted = 0;             // generations taken over from the nodes
  bool stopping = false;            // stop_atom received: no more plans
  clock_time heard_any{};           // the last message from any node
  bool last_loss_silent = false;    // the last member to go was lost to silence (not a close, not a leave)
  bool orphaned = false;            // opts.orphaned was called
  bool decide_pending = false;      // a decide_atom is in the mailbox (readiness: one judgement for a burst)
  std::optional<clock_time> settle_check;  // a decide_atom is due at the end of this settle window
  checkpoint_ledger checkpoints;             // what a plan without a state holder may name, and what ranks refused
  std::map<node_id, std::string> peers;      // node id -> routing id of its newest registration
  // Nodes that left while their ranks trained on (leave.draining), and when
  // they were last heard from (their leave, then their refused heartbeats):
  // a stop still reaches their ranks, which write its final checkpoint.
  std::map<node_id, caf::actor_clock::time_point> draining;
  caf::actor_clock::time_point last_view{};  // the last members_view emitted
  // The last plan this coordinator sent (without any node's slice), and
  // when: a member whose heartbeats still say an older generation a while
  // later (its copy was lost on a connection that had gone stale) gets its
  // slice again, at most once per resend interval.
  struct sent_plan {
    pb::envelope common;
    clock_time at{};
    std::map<node_id, clock_time> resent;
  };
  std::optional<sent_plan> last_plan;
  uint64_t plans_resent = 0;
  pause_tracker pauses;                      // this actor's own stalls, credited to every node's silence
  relay_directory relays;                    // members that can relay heartbeats, by node rank
  uint64_t relayed_beats = 0;                // members' beats relays passed on
  // Members whose last sign of life came through a relay, and that relay:
  // while the relay is silent, their silence is not held against them
  // beyond the relay's own (judged_last_seen).
  std::map<node_id, node_id> relayed_by;
  static inline const char* name = "dtactor.membership";
};

// Handles, from links::nodes: register_node (-> register_ack; its
// ready_ranks, last_generation and current_plan feed readiness and adoption),
// heartbeat (-> heartbeat_ack, or a refused register_ack telling a non-member
// to register again; a relay's beat carries its members' beats, each a sign
// of life at its age, and its ack names those that are no members;
// register_ack and heartbeat_ack name the node's relay, actors/relays.hpp; a member of the current plan whose beats still carry
// an older generation a quarter of the heartbeat timeout after the plan went
// out gets its slice again), leave. rank_status from a node marks its local rank
// ready (STATE_IDLE, STATE_READY) or not (STATE_EXITED), and STATE_FAILED of
// a rank of the current generation starts suspicion. Forwards step_report,
// rank_status, eval_report, checkpoint_written and job_error to `job`. On every
// tick (each heartbeat interval, starting at spawn): declares silent nodes
// lost (-> lost_atom to job; the suspect timeout while suspecting), runs
// decide(), and for a new plan asks `job` for the start step (plan_atom) and
// sends generation_plan to every node in it and every node leaving it. An
// adopted plan goes to `job` only. After (stop_atom) it plans nothing more.
// (ckpt_atom, step, kept): a committed checkpoint. A rank's STATE_FAILED
// with FAILURE_CHECKPOINT marks that checkpoint bad (checkpoint_refused);
// when no checkpoint is left, (fail_atom, reason) to `job` and no more plans. (shutdown_atom, reason,
// checkpoint) -> bool: `shutdown` to every node that ever registered; true
// while some node is a member.
membership_handle::behavior_type membership_actor(membership_handle::stateful_pointer<membership_actor_state> self, coordinator_options opts, outbound out,
                                                  job_handle job);

// Builds the whole wire plan, every node's ranks in it (tests compare it).
// A plan without a state holder names the newest checkpoint no rank
// refused (when there is one) to global rank 0; every plan lists the
// refused ones. What a node gets is plan_common plus its own slice.
pb::generation_plan to_proto(const plan& p, const coordinator_options& opts, int64_t start_step, const checkpoint_ledger& checkpoints = {});
// The plan as every node gets it, without any node's ranks (node_ranks
// gives the layout); add_ranks_of adds one node's slice, with the ranks of
// the generation on its host (ranks_per_host, by advertise address).
pb::generation_plan plan_common(const plan& p, const coordinator_options& opts, int64_t start_step, const checkpoint_ledger& checkpoints = {});
std::map<std::string, int32_t> ranks_per_host(const plan& p);
void add_ranks_of(pb::generation_plan& out, const plan_node& n, int32_t host_ranks);

// The plan a node reports in register_node.current_plan: generation, world
// size, state root, drain, cause and rank slots; nodes in global rank order
// with their planned local ranks (addresses, incarnations and node ranks are
// not on the wire: adoption takes them from the registrations).
plan from_proto(const pb::generation_plan& p);

// The plan's cause (none for a value this build does not know).
plan_cause cause_of(const pb::generation_plan& p);

}  // namespace dtactor
