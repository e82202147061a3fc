#pragma once
// The coordinator's view of the cluster, as plain data and pure functions (no
// CAF, no sockets, no clock reads): who is a member, which node rank each one
// holds, and whether a new generation should start. Shaped after torchft's
// lighthouse: decide(now, state, options) returns a plan or a readable reason.
#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "job/journal_events.hpp"
#include "actors/liveness.hpp"
#include "actors/node_id.hpp"

namespace dtactor {

// Why a generation starts: its names are the journal's (job/journal_events.hpp).
using ev::plan_cause;

struct membership_options {
  // cluster.min_nodes: nodes with a ready rank the job waits for before its
  // first generation (the start gate, like torchrun's --nnodes MIN).
  int32_t min_nodes = 1;
  // cluster.floor_nodes: once the job has started, the smallest number of
  // nodes it keeps training with; below it, it waits for nodes (the floor,
  // like torchft's min_replicas). At most min_nodes.
  int32_t floor_nodes = 1;
  // cluster.max_nodes: the most nodes planned into the world (the world's
  // target); registrations beyond max_nodes + standby_nodes are refused
  // (nodes started with --standby-node count among them).
  int32_t max_nodes = 64;
  // cluster.standby_nodes: nodes admitted beyond max_nodes that wait outside
  // the world, their ranks warm, and are planned in (promoted) in the same
  // re-plan that drops a lost member, so that the world keeps its size.
  int32_t standby_nodes = 0;
  // cluster.max_ranks_per_node: a registration claiming more ranks is refused.
  int32_t max_ranks_per_node = 256;
  // The generations this coordinator starts are numbered above it: the
  // newest generation committed to the checkpoint store (whose commits
  // refuse an older generation), or written to data.sample_log, by earlier
  // runs. A resumed job goes on from N + 1, not from 1 (a generation adopted
  // from the nodes keeps its number).
  uint64_t generations_after = 0;
  // A registration under the id of a member heard from within this window,
  // from another process (incarnation), is a second live process claiming
  // the id (a cloned machine), not a restart: refused with a reason naming
  // --node-id. A restart is recognised once the old process fell silent for
  // this long (3 heartbeat intervals).
  clock_duration duplicate_window{std::chrono::milliseconds(300)};
  // After an addition (a node joins, a rank becomes ready), wait this long
  // from the last addition before planning, so that nodes and ranks arriving
  // together land in one generation (cluster.settle_ms). Not when the cluster
  // is full, not once a loss of the current plan needs a new generation, and
  // not when the additions only refill places the world had before (no
  // larger than its peak, each new node with all its ranks ready).
  clock_duration settle{0};
  // A rank of the current generation reported a failed collective and no
  // membership change followed within this time: the same members start a
  // new generation (cluster.suspect_timeout_ms).
  clock_duration suspect_timeout{std::chrono::milliseconds(300)};
  // A new coordinator waits this long after the first registration for every
  // node of the generation the nodes are training in, to adopt it instead of
  // interrupting it (2 x cluster.heartbeat_timeout_ms).
  clock_duration adopt_timeout{std::chrono::milliseconds(2000)};
  // Flapping: flap_max_failures losses within flap_window quarantine a node,
  // first for `quarantine`, doubling with each further quarantine of that
  // node, at most quarantine_max (cluster.flap_*, cluster.quarantine_ms).
  int32_t flap_max_failures = 3;
  clock_duration flap_window{std::chrono::seconds(60)};
  clock_duration quarantine{std::chrono::seconds(10)};
  clock_duration quarantine_max{std::chrono::minutes(5)};
};

// The options above from the cluster.* settings.
inline membership_options membership_options_from(const cluster_settings& c) {
  membership_options o;
  o.min_nodes = c.min_nodes;
  o.floor_nodes = c.floor_nodes;
  o.duplicate_window = 3 * c.heartbeat_interval;
  o.max_nodes = c.max_nodes;
  o.standby_nodes = c.standby_nodes;
  o.max_ranks_per_node = c.max_ranks_per_node;
  o.settle = c.settle;
  o.suspect_timeout = c.suspect_timeout;
  o.adopt_timeout = 2 * c.heartbeat_timeout;
  o.flap_max_failures = c.flap_max_failures;
  o.flap_window = c.flap_window;
  o.quarantine = c.quarantine;
  return o;
}

// Empty when the options make sense together, else one line naming the keys.
std::string validate(const membership_options& o);

struct plan_node {
  dtactor::node_id node_id;
  std::string advertise_addr;
  std::string peer;
  int32_t node_rank = -1;
  int32_t nproc = 0;              // rank processes the node runs (planned or not)
  int32_t first_global_rank = 0;  // global rank of its first planned local rank
  uint64_t incarnation = 0;
  std::vector<int32_t> local_ranks;  // planned (ready) local ranks, ascending: global ranks first_global_rank, +1, ...
};

struct rank_slot {
  dtactor::node_id node_id;
  int32_t local_rank = 0;
  int32_t global_rank = 0;
  // Which readiness of that rank this is: a rank process that exited and came
  // back is ready again under a new serial (it holds no state).
  uint64_t ready_serial = 0;
};

// One generation: nodes sorted by node rank; global ranks follow that order,
// then local rank, over ready ranks only.
struct plan {
  uint64_t generation = 0;
  int32_t world_size = 0;
  // Lowest global rank that was, as the same rank process, in the previous
  // plan: it holds the committed state to broadcast. -1: nobody survived (or
  // first generation); state comes from a disk checkpoint or a fresh start.
  int32_t state_root = -1;
  std::vector<plan_node> nodes;
  std::vector<rank_slot> ranks;
  // Every rank of the previous plan is still running (only additions and
  // announced leaves): ranks finish their step and switch at a boundary they
  // agree on. False after any loss: ranks abandon their collectives at once.
  bool drain = false;
  plan_cause cause = plan_cause::none;
  // Taken over from the nodes by a restarted coordinator: already running,
  // not to be sent again.
  bool adopted = false;
  // Nodes of the previous plan that announced leave: not in this plan, but
  // they get it too, so their ranks agree on the switch boundary.
  std::vector<plan_node> leaving;
  // Standby nodes planned in: they waited outside a world at max_nodes and
  // take the place of members this plan no longer has.
  std::vector<node_id> promoted;

  const plan_node* find(const node_id& id) const;
  const rank_slot* find(const node_id& id, int32_t local_rank) const;
};

// Rebuilds p.nodes from p.ranks (sorted by global rank): each node's ranks
// are consecutive global ranks.
void group_ranks_by_node(plan& p);
// Adds the ranks of `slice` (one node's report of the same generation)
// that `into` lacks, within its world: a new coordinator assembles the
// running generation from the slices its nodes report.
void merge_slice(plan& into, const plan& slice);

// What a node says about itself in register_node (+ its envelope incarnation).
struct node_registration {
  dtactor::node_id node_id;
  std::string advertise_addr;
  int32_t nproc = 0;
  uint64_t incarnation = 0;
  std::string peer;                  // the bridge's routing id for replies (opaque here)
  std::vector<int32_t> ready_ranks;  // local ranks up and warmed (idle or training)
  uint64_t last_generation = 0;      // the newest generation the node has seen
  std::optional<plan> current_plan;  // the generation its ranks train in (after a coordinator restart)
  // Started with --standby-node: it waits outside the world, its ranks warm,
  // and is planned in only to take the place of a member the current plan
  // loses (whatever cluster.standby_nodes says).
  bool standby = false;
};

struct node_info {
  dtactor::node_id node_id;
  std::string advertise_addr;
  std::string peer;
  int32_t nproc = 0;
  int32_t node_rank = -1;
  uint64_t incarnation = 0;
  clock_time joined{};
  clock_time last_seen{};
  // When its connection closed, if it has not been heard from since.
  std::optional<clock_time> closed;
  std::map<int32_t, uint64_t> ready;  // ready local rank -> its readiness serial
  uint64_t plan_generation = 0;       // generation of the current_plan in its registration (0: none)
  // local rank -> (readiness serial, newest generation that process reported
  // READY in): it completed that generation's state agreement, so it holds
  // the generation's state. Being in a plan is not enough (a rank may be
  // planned in and lose its peers before it got any state).
  std::map<int32_t, std::pair<uint64_t, uint64_t>> synced;
  bool standby = false;  // registered with --standby-node (node_registration::standby)
};

// A node's recent losses, for flap detection.
struct flap_record {
  std::vector<clock_time> failures;  // within flap_window, oldest first
  int32_t quarantines = 0;           // times quarantined so far
  std::optional<clock_time> until;   // refused until then
  std::string reason;                // the last quarantine's
};

struct membership_state {
  std::map<node_id, node_info> nodes;           // live members by node id
  std::map<node_id, int32_t> remembered_ranks;  // node id -> node rank it last held (members and departed)
  std::optional<plan> current;                      // the last plan committed
  uint64_t last_generation = 0;
  clock_time last_change{};
  uint64_t last_serial = 0;  // readiness serials handed out
  // Since the current plan: the last addition (settling counts from it), a
  // loss of the current plan (no settling then), the most severe change, the
  // nodes that left.
  std::optional<clock_time> settling_since;
  bool loss_pending = false;
  // The largest world (ranks) a plan of this job had under this coordinator
  // (committed or adopted): a join that only brings the world back up to it
  // fills places that a loss or a leave emptied, and is planned without
  // settling.
  int32_t peak_world = 0;
  plan_cause pending_cause = plan_cause::none;
  std::map<node_id, plan_node> leaving;
  // First STATE_FAILED of a rank of the current generation.
  std::optional<clock_time> suspect_since;
  // Coordinator restart: the newest plan nodes said they train in, and when
  // the first node registered with a coordinator that had no plan.
  std::optional<plan> reported_plan;
  std::optional<clock_time> first_registration;
  std::map<node_id, flap_record> flaps;
};

struct plan_decision {
  std::optional<plan> next;  // set: start this generation (or adopt it, when next->adopted)
  std::string reason;        // always set: why (not), for logs and status pages
  // The job has started and has fewer ready nodes than cluster.floor_nodes:
  // it waits for nodes instead of training (journaled as job_waiting).
  bool below_floor = false;
  // Settling: when the window ends, unless a further addition moves it.
  std::optional<clock_time> settles_at;
};

// Pure: whether `state` calls for a new generation at `now`. Without a
// current plan, adopts the newest reported plan once all its nodes and ranks
// are back (until options.adopt_timeout after the first registration). A
// plan is made when at least min_nodes have a ready rank and the members'
// (node id, incarnation, ready local ranks, node rank, address) differ from
// the current plan's, after settling; or, with the same members, when a
// suspected collective failure was not followed by a change within
// suspect_timeout.
plan_decision decide(clock_time now, const membership_state& state, const membership_options& opts);

// The plan `state`'s members would form as `generation` (no checks), with
// drain and cause filled from the changes since the current plan. At most
// opts.max_nodes nodes are planned (members of the current plan first, then
// by node rank); the others wait outside as standbys. A node registered as a
// standby (--standby-node) is planned only into a place of the current plan
// (after a coordinator restart, of the plan its nodes reported) that no
// other node fills: it replaces a lost or departed member, never grows the
// world; once planned it stays in the world like any member.
plan make_plan(const membership_state& state, uint64_t generation, const membership_options& opts = {});

// Members that wait outside the world as standbys now: nodes started with
// --standby-node that hold no place, and nodes with a ready rank that a plan
// made now would leave out (beyond max_nodes: cluster.standby_nodes). A
// node joining into room is not one (it is planned at the next plan).
std::set<node_id> waiting_standbys(const membership_state& state, const membership_options& opts);

// Why `id` cannot name a node ("" when it can): 1 to 128 characters of
// letters, digits, '.', '_' and '-' (host names, pod names and Slurm node
// names fit). Node ids go into log lines, progress lines, journal events,
// metric labels and file names; a stranger's id with terminal escapes or
// newlines must not reach any of them. The problem is printable.
std::string node_id_problem(const std::string& id);

struct admission {
  bool accepted = false;
  int32_t node_rank = -1;
  bool changed = false;      // membership differs from before (a new generation may be due)
  bool rejoined = false;     // got back the node rank it held before
  bool joined = false;       // a new member, or a new process of one (not a retried register)
  bool restarted = false;    // a member came back as a new process: its old one is lost
  double silent_s = 0;       // when restarted: seconds since the old process's last sign of life
  bool quarantined = false;  // refused (or just quarantined) for flapping
  bool duplicate = false;    // refused: a live member of another process holds this id
  std::string reason;        // why not, when refused
};

enum class departure { lost, left };

struct removal {
  bool removed = false;
  bool quarantined = false;  // this loss made the node a flapper
  std::string reason;        // the quarantine's, when quarantined
  explicit operator bool() const { return removed; }
};

// The node ranks members hold, so that a registration finds the lowest free
// one in O(log n) instead of collecting every member's (a cold start of
// thousands of nodes registers each against all the others).
class rank_use {
 public:
  void add(int32_t r);
  void remove(int32_t r);
  bool held(int32_t r) const;
  // The lowest rank no member holds; the lowest such above `r`.
  int32_t lowest_free() const;
  int32_t free_after(int32_t r) const;
  void clear();

 private:
  std::vector<int32_t> count_;  // members holding each rank
  std::set<int32_t> free_;      // ranks below count_.size() none holds
};

class membership {
 public:
  explicit membership(membership_options opts = {});

  // register_node. Node ranks are deterministic: a node gets back the rank it
  // last held if no member holds it; otherwise the lowest rank that is neither
  // held nor remembered for a departed node (ranks stay below max_nodes,
  // forgetting the oldest departed holder's claim if needed). The same node id
  // with a new incarnation is a restart: same rank, its old ranks are lost
  // (counted for flapping), unless the old process was heard from within
  // duplicate_window: then two live processes claim one id and the newcomer
  // is refused (the member stays). The registration's ready_ranks replace the
  // node's ready set. Refused with a reason beyond max_nodes + standby_nodes, or while
  // quarantined.
  admission admit(const node_registration& reg, clock_time now);

  // A lost or departed node leaves; its rank is remembered. A loss counts
  // towards quarantine; a leave of a node in the current plan lets the next
  // plan drain and sends it that plan. Not removed: it was not a member.
  removal remove(const node_id& id, clock_time now, departure why = departure::lost);

  // Marks a local rank of a member (this incarnation) ready to be planned, or
  // not (its process exited). True if that changed anything.
  bool set_rank_ready(const node_id& id, uint64_t incarnation, int32_t local_rank, bool ready, clock_time now);
  // The rank reported STATE_READY in `generation`: it holds that
  // generation's state. Only such ranks of the current plan (or of an
  // adopted one) are state roots of the next plan; without one, the plan
  // carries the newest checkpoint.
  void note_synced(const node_id& id, uint64_t incarnation, int32_t local_rank, uint64_t generation);

  // A rank reported a failed collective in `generation`. Starts suspicion
  // (true) when that is the current generation, the rank is in it, and no
  // suspicion is running; a commit ends it.
  bool report_failure(uint64_t generation, const node_id& id, int32_t local_rank, clock_time now);
  bool suspecting() const { return state_.suspect_since.has_value(); }

  // Non-empty while `id` is quarantined at `now`: why, and for how long.
  std::string quarantine_reason(const node_id& id, clock_time now) const;

  // A sign of life (heartbeat). False, and nothing recorded, if `id` is
  // not a member with this incarnation (declared lost, or an old process). A
  // non-empty `peer` replaces the routing id (the node reconnected).
  bool touch(const node_id& id, uint64_t incarnation, clock_time now, const std::string& peer = {});
  // A sign of life a relay passed on (actors/relays.hpp): `id` was heard at
  // `seen_at` (by the relay's clock, as an age). As touch, but it keeps the
  // routing id, and a closed connection stays marked unless the beat came
  // more than `after_close` after the close (a beat the relay heard just
  // after it may have been sent before it).
  bool sighted(const node_id& id, uint64_t incarnation, clock_time seen_at, clock_duration after_close);

  // The connection of the member at routing id `peer` closed: it is marked
  // until it is heard from again (touch, a registration). Returns its node
  // id; empty when no member is at that routing id (it reconnected).
  node_id connection_closed(const std::string& peer, clock_time now);
  // Members whose connection closed and that were not heard from since.
  std::map<node_id, clock_time> closed() const;

  plan_decision decide(clock_time now) const { return dtactor::decide(now, state_, opts_); }

  // Records `p` as the current generation (what decide() returned). An
  // adopted plan also gives its nodes node ranks in its global rank order.
  const plan& commit(plan p);

  // The watcher paused for `pause` (pause_tracker): every node's silence
  // so far, and the time since a closed connection, move forward by it,
  // never past `now`.
  void credit_pause(clock_duration pause, clock_time now);
  std::map<node_id, clock_time> last_seen() const;
  const node_info* find(const node_id& id) const;
  const membership_state& state() const { return state_; }
  const membership_options& options() const { return opts_; }

 private:
  int32_t assign_rank(const node_id& id);
  bool in_current(const node_id& id, uint64_t incarnation) const;
  void note_addition(plan_cause cause, clock_time now);
  void note_loss(plan_cause cause, bool in_plan, clock_time now);
  // Counts a loss of `id`; true when it reaches quarantine.
  bool note_failure(const node_id& id, clock_time now);
  bool mark_ready(node_info& n, int32_t local_rank, bool ready, clock_time now);
  // admit()'s parts. Takes the generation (and, before the first plan, the
  // plan) a registering node reports.
  void adopt_reported(const node_registration& reg, clock_time now);
  // The member `n` registered again with its incarnation and nproc (a retry
  // or a reconnect): its address, peer and ready ranks are refreshed.
  admission readmit(node_info& n, const node_registration& reg, const std::set<int32_t>& ready, clock_time now);
  // A node not (or no longer) a member joins: a rank (its remembered one
  // when free), its ready ranks; sets `a` accepted and joined.
  void join_node(const node_registration& reg, const std::set<int32_t>& ready, clock_time now, admission& a);
  // Ranks remembered for departed nodes (not members), but `id`'s: rank ->
  // that node. Empty without a walk when every remembered node is a member.
  std::map<int32_t, node_id> departed_claims(const node_id& id) const;
  void erase_member(std::map<node_id, node_info>::iterator it);

  membership_options opts_;
  membership_state state_;
  rank_use ranks_;  // of state_.nodes
};

}  // namespace dtactor
