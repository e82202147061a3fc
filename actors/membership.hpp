#pragma once
// The coordinator's view of the cluster, as plain data and pure functions (no
// CAF, no sockets, no clock reads): who is a member, which node rank each one
// holds, and whether a new generation should start. Shaped after torchft's
// lighthouse: decide(now, state, options) returns a plan or a readable reason.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "actors/liveness.hpp"

namespace dtactor {

struct membership_options {
  int32_t min_nodes = 1;   // cluster.min_nodes: members needed before any plan
  int32_t max_nodes = 64;  // cluster.max_nodes: more registrations are refused
  // After a membership change, wait this long for further changes before
  // planning (nodes started together land in one generation), unless the
  // cluster is full. Zero plans at the first decision after the change.
  clock_duration settle{0};
};

// Reads cluster.min_nodes / cluster.max_nodes from a dtactor::config (a
// template so this library does not link the config implementation).
template <class Config>
membership_options membership_options_from(const Config& cfg) {
  membership_options o;
  o.min_nodes = static_cast<int32_t>(cfg.get_int("cluster.min_nodes"));
  o.max_nodes = static_cast<int32_t>(cfg.get_int("cluster.max_nodes"));
  return o;
}

// What a node says about itself in register_node (+ its envelope incarnation).
struct node_registration {
  std::string node_id;
  std::string advertise_addr;
  int32_t nproc = 0;
  uint64_t incarnation = 0;
  std::string peer;  // the bridge's routing id for replies (opaque here)
};

struct node_info {
  std::string node_id;
  std::string advertise_addr;
  std::string peer;
  int32_t nproc = 0;
  int32_t node_rank = -1;
  uint64_t incarnation = 0;
  clock_time joined{};
  clock_time last_seen{};
};

struct plan_node {
  std::string node_id;
  std::string advertise_addr;
  std::string peer;
  int32_t node_rank = -1;
  int32_t nproc = 0;
  int32_t first_global_rank = 0;  // its local rank l is global rank first_global_rank + l
  uint64_t incarnation = 0;
};

struct rank_slot {
  std::string node_id;
  int32_t local_rank = 0;
  int32_t global_rank = 0;
};

// One generation: nodes sorted by node rank; global ranks follow that order,
// then local rank; world size is the sum of nproc.
struct plan {
  uint64_t generation = 0;
  int32_t world_size = 0;
  // Lowest global rank on a node that was (same incarnation) in the previous
  // plan: it holds the committed state to broadcast. -1: nobody survived (or
  // first generation); state comes from a disk checkpoint or a fresh start.
  int32_t state_root = -1;
  std::vector<plan_node> nodes;
  std::vector<rank_slot> ranks;

  const plan_node* find(const std::string& node_id) const;
};

struct membership_state {
  std::map<std::string, node_info> nodes;           // live members by node_id
  std::map<std::string, int32_t> remembered_ranks;  // node_id -> node rank it last held (members and departed)
  std::optional<plan> current;                      // the last plan committed
  uint64_t last_generation = 0;
  clock_time last_change{};
};

struct plan_decision {
  std::optional<plan> next;  // set: start this generation
  std::string reason;        // always set: why (not), for logs and status pages
};

// Pure: whether `state` calls for a new generation at `now`. A plan is made
// when at least min_nodes are members and the members differ from the current
// plan's (node id, incarnation, nproc, node rank, address).
plan_decision decide(clock_time now, const membership_state& state, const membership_options& opts);

// The plan `state`'s members would form as `generation` (no checks).
plan make_plan(const membership_state& state, uint64_t generation);

struct admission {
  bool accepted = false;
  int32_t node_rank = -1;
  bool changed = false;   // membership differs from before (a new generation is due)
  bool rejoined = false;  // got back the node rank it held before
  std::string reason;     // why not, when refused
};

class membership {
 public:
  explicit membership(membership_options opts = {});

  // register_node. Node ranks are deterministic: a node gets back the rank it
  // last held if no member holds it; otherwise the lowest rank that is neither
  // held nor remembered for a departed node (ranks stay below max_nodes,
  // forgetting the oldest departed holder's claim if needed). The same node id
  // with a new incarnation is a restart: same rank, membership changed. Beyond
  // max_nodes members, refused with a reason.
  admission admit(const node_registration& reg, clock_time now);

  // A lost or departed node leaves; its rank is remembered. False if it was
  // not a member.
  bool remove(const std::string& node_id, clock_time now);

  // A sign of life (heartbeat). False, and nothing recorded, if `node_id` is
  // not a member with this incarnation (declared lost, or an old process). A
  // non-empty `peer` replaces the routing id (the node reconnected).
  bool touch(const std::string& node_id, uint64_t incarnation, clock_time now, const std::string& peer = {});

  plan_decision decide(clock_time now) const { return dtactor::decide(now, state_, opts_); }

  // Records `p` as the current generation (what decide() returned).
  const plan& commit(plan p);

  std::map<std::string, clock_time> last_seen() const;
  const node_info* find(const std::string& node_id) const;
  const membership_state& state() const { return state_; }
  const membership_options& options() const { return opts_; }

 private:
  int32_t assign_rank(const std::string& node_id);

  membership_options opts_;
  membership_state state_;
};

}  // namespace dtactor
