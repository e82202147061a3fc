#pragma once
// The node agent: one per machine. A small state machine in the manner of
// CAF's distributed_calculator client:
//
//   unregistered --start--> registering --register_ack(accepted)--> registered
//   registered --generation_plan--> running
//   registered|running --coordinator silent past the timeout, told "not a
//                        member", or a connection to a coordinator address
//                        came up--> registering (ranks keep running)
//   any --leave_atom--> leaving (ranks finish their step: the coordinator's
//       drain plan leaves them out, they report STATE_IDLE and are stopped)
//   any --shutdown--> stopped  (shutdown with `checkpoint` is only relayed:
//       ranks stop at an agreed step after a final checkpoint; a node that
//       is leaving then waits for that stop instead of its leave timeout)
//
// It registers (retrying with capped exponential backoff until acked),
// heartbeats the coordinator every interval, forwards generation plans to its
// ranks and relays their reports, and supervises the rank processes through
// an injected process_launcher: a rank that exits is reported to the
// coordinator (rank_status STATE_EXITED) and restarted after a backoff, and
// a rank whose heartbeats stop (hung) is killed, then restarted. A fresh rank
// gets a warm-up plan (the job's config) and is planned in by the
// coordinator once it reports STATE_IDLE.
//
// One behavior with an explicit phase rather than become(): rank exits,
// timers and reports must be handled in every phase, and CAF drops messages
// the current behavior does not match.
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "actors/liveness.hpp"
#include "actors/messages.hpp"
#include "actors/node_id.hpp"
#include "actors/relays.hpp"
#include "actors/spare_pool.hpp"
#include "caf/replies_to.hpp"
#include "caf/stateful_actor.hpp"
#include "caf/typed_actor.hpp"
#include "caf/typed_event_based_actor.hpp"
#include "dtactor/result.hpp"

namespace dtactor {

// Starts and stops rank processes. Implementations never block on a child.
// Exits are reported by whoever owns the launcher (e.g. a waitpid thread) as
// caf::anon_send(agent, rank_exit_atom::value, pid, exit_code); the agent
// knows which of its ranks runs as that pid.
class process_launcher {
 public:
  virtual ~process_launcher() = default;
  // Starts the rank process for `local_rank`; its pid, or one line saying why not.
  virtual result<int32_t> spawn(int32_t local_rank) = 0;
  // Starts a warm spare rank process (no local rank until the agent gives
  // it one: actors/spare_pool.hpp); its pid, or why not. Its exit is
  // reported as a rank's.
  virtual result<int32_t> spawn_spare() { return make_error("this node starts no spare rank processes"); }
  // Asks the process to end (SIGTERM; SIGKILL after a grace period if it
  // does not); its exit is still reported.
  virtual void terminate(int32_t pid) = 0;
  // Ends the process now (SIGKILL): a rank that fell silent; its exit is
  // still reported.
  virtual void kill(int32_t pid) = 0;
};

// What the node agent tells its process, as typed values: the process wires
// them to its metrics and its exit (app/node.cpp); nothing outside the agent
// reads the envelopes it relays. Called on the agent's thread; the sink must
// not block.
namespace nev {
// The coordinator accepted this node into job `job_id`.
struct registered {
  std::string job_id;
  int32_t node_rank = -1;
};
// The coordinator refused this node for good (shutdown.refused): the
// process exits 1 with `reason`. Emitted before the agent quits.
struct refused {
  std::string reason;
};
// A heartbeat came back; `echoed_sent_steady_s` is when it was sent
// (steady clock seconds of this process).
struct heartbeat_acked {
  double echoed_sent_steady_s = 0;
};
// A rank process it started said hello on the ranks' link as `peer`.
struct rank_started {
  int32_t local_rank = 0;
  int32_t pid = 0;
  std::string peer;
};
// A generation plan newer than the last one reached this node.
struct plan_received {
  uint64_t generation = 0;
  int32_t world_size = 0;
};
// One of its ranks reported steps (already annotated, see
// node_agent_options::annotate_report), on its way to the coordinator.
struct steps_reported {
  pb::step_report report;
};
// The node's warm spares changed: `warm` wait now; `taken` of them took
// a rank's place just now (0 or 1).
struct spares {
  int32_t warm = 0;
  int32_t taken = 0;
  std::vector<int32_t> pids;  // every spare process waiting now, warming up or warm (their memory: /metrics)
};
// Every rank of this node was given up (node_agent_options::rank_exit_limit):
// the node leaves the job, and its process exits 1 with `reason`. Emitted
// before the agent quits.
struct gave_up {
  std::string reason;
};
}  // namespace nev
using node_event =
    std::variant<nev::registered, nev::refused, nev::heartbeat_acked, nev::rank_started, nev::plan_received, nev::steps_reported, nev::gave_up, nev::spares>;
using node_event_sink = std::function<void(const node_event&)>;

struct node_agent_options {
  dtactor::node_id node_id;
  std::string advertise_addr;
  std::string hostname;
  int32_t nproc = 1;
  int32_t metrics_port = 0;
  // --standby-node: registers as a standby, kept outside the world until a
  // member is lost (register_node.standby; actors/membership.hpp).
  bool standby = false;
  envelope_header header;     // sender "node/<node_id>", this process's incarnation
  liveness_options liveness;  // heartbeat period; coordinator silence that triggers re-registration
  // Registers are retried 100 ms, 200 ms, ... apart, at most 1 s and never
  // more than a third of liveness.heartbeat_timeout (a registering member
  // sends nothing else, and silence for the timeout is a loss): a node cut
  // off for a while is back soon after the heal (a register is a few
  // hundred bytes).
  std::chrono::milliseconds register_backoff_initial{100};
  std::chrono::milliseconds register_backoff_max{1000};
  std::chrono::milliseconds restart_backoff_initial{100};
  std::chrono::milliseconds restart_backoff_max{5000};
  // How long a leaving node waits for the plan that lets its ranks finish
  // their step (the coordinator may be gone) before it stops them anyway.
  std::chrono::milliseconds leave_timeout{10000};
  // How long a node waits for the coordinator's final shutdown once the job
  // is being stopped (it waits up to 30 s for the final checkpoint).
  std::chrono::milliseconds stop_timeout{40000};
  // How long ranks told to end by the final shutdown may take to exit
  // before they are terminated (SIGUSR2, then SIGKILL): a rank whose
  // message was lost, or stuck on its way out, never keeps the node up.
  std::chrono::milliseconds shutdown_grace{10000};
  // Reads the job's heartbeat settings from the config in register_ack
  // (may be empty: the options above stay).
  std::function<std::optional<liveness_options>(const std::string& config_toml)> liveness_from_config;
  // After this many non-zero exits of the node's ranks in a row with no step
  // beyond those reported before (out of memory at the same step, or broken
  // there), the rank that exited last is not started again
  // (cluster.rank_exit_limit); the job goes on with the node's other ranks,
  // and a node left with none leaves the job. 0: restarted forever.
  int32_t rank_exit_limit = 5;
  // Reads cluster.rank_exit_limit from the config in register_ack (may be
  // empty; nullopt keeps the option above).
  std::function<std::optional<int32_t>(const std::string& config_toml)> rank_exit_limit_from_config;
  // Warm spare rank processes to keep (--spares; actors/spare_pool.hpp);
  // none: the job's cluster.spare_ranks, read by spares_from_config from
  // the config in register_ack (0 when that is empty too).
  std::optional<int32_t> spares;
  std::function<std::optional<int32_t>(const std::string& config_toml)> spares_from_config;
  spare_pool_options spare_pool;
  log_fn log;
  // Where this node listens for its relay group's heartbeats (links::relay_in;
  // register_node.relay_endpoint); empty: it never relays.
  std::string relay_endpoint;
  // Opens links::relay to a relay's endpoint, replacing the one open (empty:
  // closes it). Called on the agent's thread (may be empty: nothing is dialled).
  std::function<void(const std::string& endpoint)> dial_relay;
  // Everything worth a metric or the process's exit (may be empty).
  node_event_sink events;
  // Adds what only the node knows (the rank process's CPU and memory, the
  // node id) to a rank's step report before it is relayed; `peer` is the
  // rank's link id (may be empty).
  std::function<void(const std::string& peer, pb::step_report&)> annotate_report;
};

// initial * 2^attempt, capped at `max` (attempt 0 -> initial).
std::chrono::milliseconds backoff_delay(std::chrono::milliseconds initial, std::chrono::milliseconds max, uint32_t attempt);

enum class node_phase { unregistered, registering, registered, running, leaving, stopped };
const char* to_string(node_phase p);

struct rank_process {
  int32_t pid = -1;
  bool alive = false;
  std::string peer;            // routing id on links::ranks once it said rank_hello
  bool ready = false;          // warmed up (STATE_IDLE) or training: may be planned in
  clock_time last_seen{};      // its last heartbeat or report
  // Its STATE_FINISHED of the current generation, sent again after a
  // re-registration (the coordinator may have restarted and missed it).
  std::optional<pb::envelope> finished;
  uint32_t starts = 0;         // successful spawns
  uint32_t failures = 0;       // exits/spawn failures since it last reported STATE_READY
  // The node gave this rank up (rank_exit_limit).
  bool given_up = false;
  uint64_t restart_epoch = 0;  // matches the pending restart_atom timer
  bool restart_pending = false;
};

struct node_agent_state {
  node_agent_options opts;
  outbound out;
  std::shared_ptr<process_launcher> launcher;
  node_phase phase = node_phase::unregistered;
  uint64_t register_epoch = 0;  // bumps on each entry to `registering`
  uint32_t register_attempt = 0;
  uint64_t registers_sent = 0;
  int32_t node_rank = -1;
  std::string job_id;
  std::string config_toml;
  std::string checkpoint_store, module_object, module_digest;  // from register_ack, for warm-up plans
  std::string last_refusal;
  clock_time last_heard{};  // last envelope from the coordinator
  pause_tracker pauses;     // this agent's own stalls, credited to the coordinator's and the ranks' silence
  uint64_t heartbeat_seq = 0;
  // The interval the coordinator asked for (register_ack, heartbeat_ack;
  // 0: opts.liveness.heartbeat_interval), when this agent last beat, and
  // when it last asked for an ack (actors/liveness.hpp ack_every).
  std::chrono::milliseconds heartbeat_every{0};
  clock_time last_beat{}, ack_asked{};
  // Heartbeat relays (actors/relays.hpp): where this node beats; its
  // group's assignment as the coordinator last said it (passed on to the
  // group's members when this node relays); the members' beats it relays.
  relay_link relay;
  pb::relay_assignment group_relay;
  relay_hub hub;
  std::optional<pb::generation_plan> plan;
  std::vector<rank_process> ranks;
  spare_pool spares;  // warm spare rank processes, waiting for a slot
  int64_t last_step = 0;
  // Non-zero exits of this node's ranks since one of them last reported a
  // step beyond any reported before (a rank resumed from an older checkpoint
  // that dies at the same step again made no progress). Counted for the node,
  // not a rank: the kernel's OOM killer picks whichever rank is largest, a
  // different one from one generation to the next.
  uint32_t exits_without_step = 0;
  int64_t best_step = -1;
  // The coordinator is stopping the job (shutdown with a checkpoint came):
  // a leave of this node (its own SIGINT/SIGTERM, as when a terminal's
  // Ctrl-C reaches every process) no longer stops the ranks early; they stop
  // with the job, within stop_timeout.
  bool job_stopping = false;
  static inline const char* name = "dtactor.node_agent";
};

// What the node agent takes:
// (start_atom): register, then heartbeat every interval.
// inbound: a frame from the coordinator (links::coordinator) or a rank (links::ranks).
// (rank_exit_atom, pid, exit_code): a rank process ended (its launcher's owner).
// (reachable_atom, endpoint): the connection to a coordinator address came
//   up: a registering node registers at once, a member registers again.
// (leave_atom, reason): leave the job (a signal, the coordinator unreachable).
// (leave_atom, reason, cloud, announced, announced_unix_s, noticed_unix_s):
//   the cloud's preemption notice, a leave the coordinator journals.
// Its own timers: (tick_atom) heartbeat; (retry_atom, register_epoch) a
// register retry; (restart_atom, local_rank, restart_epoch) a rank's restart
// delay; (leave_due_atom) the leave timeout; (stop_due_atom) the stop timeout.
using node_agent_handle =
    caf::typed_actor<caf::reacts_to<start_atom>, caf::reacts_to<inbound>, caf::reacts_to<rank_exit_atom, int32_t, int32_t>,
                     caf::reacts_to<leave_atom, std::string>, caf::reacts_to<leave_atom, std::string, std::string, std::string, double, double>,
                     caf::reacts_to<tick_atom>, caf::reacts_to<retry_atom, uint64_t>, caf::reacts_to<restart_atom, int32_t, uint64_t>,
                     caf::reacts_to<leave_due_atom>, caf::reacts_to<stop_due_atom>, caf::reacts_to<reachable_atom, std::string>>;

node_agent_handle::behavior_type node_agent(node_agent_handle::stateful_pointer<node_agent_state> self, node_agent_options opts, outbound out,
                                            std::shared_ptr<process_launcher> launcher);

}  // namespace dtactor
