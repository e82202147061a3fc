// Planning a generation from the membership state (actors/membership.hpp):
// who is planned, whether to plan now, and why not.
#include "actors/membership.hpp"

#include "base/printable.hpp"

#include <cctype>
#include <cstdio>

#include <algorithm>
#include <set>
#include <sstream>

namespace dtactor {

namespace {

double seconds(clock_duration d) { return std::chrono::duration<double>(d).count(); }

std::string join(const std::vector<node_id>& xs) {
  std::string out = "[";
  for (const auto& x : xs) {
    if (out.size() > 1) out += ", ";
    out += x.str();
  }
  return out + "]";
}

// Node ids listed in a waiting reason, the rest counted: the coordinator logs
// the reason whenever it changes, at every registration of a cold start, so
// a full list of thousands of nodes each time would cost the coordinator
// time and log space that grow with the square of the nodes.
constexpr std::size_t waiting_ids_listed = 16;

std::string join_some(const std::vector<node_id>& xs) {
  if (xs.size() <= waiting_ids_listed) return join(xs);
  std::string out = join(std::vector<node_id>(xs.begin(), xs.begin() + waiting_ids_listed));
  out.pop_back();
  return out + ", ... (" + std::to_string(xs.size() - waiting_ids_listed) + " more)]";
}

bool has_ready(const node_info& n) { return !n.ready.empty(); }

std::vector<node_id> node_ids(const membership_state& s, bool ready) {
  std::vector<node_id> out;
  for (const auto& [id, n] : s.nodes)
    if (has_ready(n) == ready) out.push_back(id);
  return out;
}

// The member `n` is in the current plan, as the same process.
bool in_plan(const membership_state& s, const node_info& n) {
  const auto* pn = s.current ? s.current->find(n.node_id) : nullptr;
  return pn && pn->incarnation == n.incarnation;
}

bool by_node_rank(const node_info* a, const node_info* b) {
  return a->node_rank != b->node_rank ? a->node_rank < b->node_rank : a->node_id < b->node_id;
}

// A node registered as a standby (--standby-node) holds a place in the
// world: it is in the current plan as this process or, before a plan was
// committed, in the plan its nodes reported (a coordinator restart).
bool seated(const membership_state& s, const node_info& n) {
  if (s.current) return in_plan(s, n);
  return s.reported_plan && s.reported_plan->find(n.node_id);
}

bool waits_as_standby(const membership_state& s, const node_info& n) { return n.standby && !seated(s, n); }

// The world's places that standbys by flag may fill: those of the current
// plan (or, before one, of the reported plan), at most max_nodes.
size_t world_places(const membership_state& s, int32_t max_nodes) {
  const plan* p = s.current ? &*s.current : s.reported_plan ? &*s.reported_plan : nullptr;
  return p ? std::min(p->nodes.size(), static_cast<size_t>(std::max(max_nodes, 0))) : 0;
}

// Members with a ready rank, in plan order (node rank, then id), at most
// max_nodes of them: members of the current plan keep their places and
// other nodes fill the rest by node rank; the others wait outside
// (cluster.standby_nodes). Standbys by flag then fill, by node rank, the
// world's places nobody else took.
std::vector<const node_info*> planned_nodes(const membership_state& s, const membership_options& opts) {
  std::vector<const node_info*> order, standbys;
  for (const auto& [id, n] : s.nodes)
    if (has_ready(n)) (waits_as_standby(s, n) ? standbys : order).push_back(&n);
  if (static_cast<int32_t>(order.size()) > opts.max_nodes) {
    std::sort(order.begin(), order.end(), [&](const node_info* a, const node_info* b) {
      const bool pa = in_plan(s, *a), pb = in_plan(s, *b);
      return pa != pb ? pa : by_node_rank(a, b);
    });
    order.resize(static_cast<size_t>(std::max(opts.max_nodes, 0)));
  }
  std::sort(standbys.begin(), standbys.end(), by_node_rank);
  const size_t places = world_places(s, opts.max_nodes);
  for (size_t i = 0; i < standbys.size() && order.size() < places; ++i) order.push_back(standbys[i]);
  std::sort(order.begin(), order.end(), by_node_rank);
  return order;
}

// Planned nodes that waited outside the world: standbys by flag, and, while
// the current plan is at max_nodes, nodes beyond it (cluster.standby_nodes):
// standbys promoted into the next plan.
std::vector<node_id> promoted_standbys(const membership_state& s, const std::vector<const node_info*>& planned, const membership_options& opts) {
  const bool at_max = opts.standby_nodes > 0 && s.current && static_cast<int32_t>(s.current->nodes.size()) >= opts.max_nodes;
  std::vector<node_id> out;
  for (const auto* n : planned)
    if (waits_as_standby(s, *n) || (at_max && !in_plan(s, *n))) out.push_back(n->node_id);
  return out;
}

bool same_members(const plan& p, const membership_state& s, const membership_options& opts) {
  auto order = planned_nodes(s, opts);
  if (p.nodes.size() != order.size()) return false;
  for (size_t i = 0; i < order.size(); ++i) {
    const auto& pn = p.nodes[i];
    const auto& n = *order[i];
    if (pn.node_id != n.node_id || n.incarnation != pn.incarnation || n.node_rank != pn.node_rank || n.advertise_addr != pn.advertise_addr ||
        pn.local_ranks.size() != n.ready.size())
      return false;
  }
  for (const auto& r : p.ranks) {
    const auto& ready = s.nodes.at(r.node_id).ready;
    auto it = ready.find(r.local_rank);
    if (it == ready.end() || it->second != r.ready_serial) return false;
  }
  return true;
}

// The same rank process is still ready (same node incarnation, same serial).
bool still_ready(const membership_state& s, const plan& prev, const rank_slot& r) {
  auto it = s.nodes.find(r.node_id);
  if (it == s.nodes.end()) return false;
  const auto* pn = prev.find(r.node_id);
  if (!pn || pn->incarnation != it->second.incarnation) return false;
  auto ready = it->second.ready.find(r.local_rank);
  return ready != it->second.ready.end() && ready->second == r.ready_serial;
}

// The same rank process reported READY in generation `g`.
bool holds_state_of(const node_info& n, int32_t local_rank, uint64_t g) {
  auto s = n.synced.find(local_rank);
  auto r = n.ready.find(local_rank);
  return s != n.synced.end() && r != n.ready.end() && s->second.first == r->second && s->second.second == g;
}

bool can_drain(const membership_state& s) {
  if (!s.current || s.suspect_since) return false;
  for (const auto& r : s.current->ranks)
    if (!s.leaving.count(r.node_id) && !still_ready(s, *s.current, r)) return false;
  return true;
}

plan_cause cause_of_next(const membership_state& s) {
  if (!s.current) return s.reported_plan || s.last_generation > 0 ? plan_cause::restart : plan_cause::start;
  if (s.pending_cause != plan_cause::none) return s.pending_cause;
  return s.suspect_since ? plan_cause::collective_failure : plan_cause::node_joined;
}

// Every place in the world (max_nodes) is taken by a member with all its
// ranks ready: nothing that joins now could be planned in (standbys wait
// outside), so there is nothing to settle for.
bool full(const membership_state& s, const membership_options& opts) {
  int32_t complete = 0;
  for (const auto& [id, n] : s.nodes)
    if (static_cast<int32_t>(n.ready.size()) >= n.nproc && !waits_as_standby(s, n)) ++complete;
  return complete >= opts.max_nodes;
}

// The additions since the current plan only refill places emptied by a loss
// or a leave: the world planned now is no larger than the largest this job
// had, and every node new to the world has all its ranks ready (a node half
// ready would be planned again a moment later). A wave of joins that grows
// the job beyond its peak still settles.
bool refills_places(const membership_state& s, const std::vector<const node_info*>& planned) {
  if (!s.current || s.peak_world == 0) return false;
  int32_t world = 0;
  for (const auto* n : planned) {
    world += static_cast<int32_t>(n->ready.size());
    if (!s.current->find(n->node_id) && static_cast<int32_t>(n->ready.size()) < n->nproc) return false;
  }
  return world <= s.peak_world;
}

// Empty when every node and rank of the reported plan is back, else what is
// missing.
std::string adoption_gap(const membership_state& s) {
  const auto& p = *s.reported_plan;
  // Each node reports its own slice: the generation is whole once the
  // slices cover its world.
  if (static_cast<int32_t>(p.ranks.size()) < p.world_size)
    return "the nodes of " + std::to_string(p.world_size - static_cast<int32_t>(p.ranks.size())) + " of its " + std::to_string(p.world_size) +
           " ranks have not registered";
  for (const auto& pn : p.nodes) {
    auto it = s.nodes.find(pn.node_id);
    if (it == s.nodes.end()) return "node '" + pn.node_id.str() + "' has not registered";
    if (it->second.plan_generation != p.generation) return "node '" + pn.node_id.str() + "' is in generation " + std::to_string(it->second.plan_generation);
    for (int32_t l : pn.local_ranks)
      if (!it->second.ready.count(l)) return "rank " + std::to_string(l) + " of node '" + pn.node_id.str() + "' is not ready";
  }
  return {};
}

plan adopted_plan(const membership_state& s) {
  plan p = *s.reported_plan;
  p.adopted = true;
  p.leaving.clear();
  int32_t node_rank = 0;
  for (auto& pn : p.nodes) {
    const auto& n = s.nodes.at(pn.node_id);
    pn.advertise_addr = n.advertise_addr;
    pn.peer = n.peer;
    pn.incarnation = n.incarnation;
    pn.nproc = n.nproc;
    pn.node_rank = node_rank++;
  }
  for (auto& r : p.ranks) r.ready_serial = s.nodes.at(r.node_id).ready.at(r.local_rank);
  return p;
}

std::vector<node_id> ids_of(const std::vector<const node_info*>& nodes) {
  std::vector<node_id> out;
  for (const auto* n : nodes) out.push_back(n->node_id);
  return out;
}

// Why the job waits for nodes: `planned` (what a plan would hold now) is
// below `need` (the floor once `started`, else min_nodes).
std::string waiting_reason(const membership_state& s, const std::vector<const node_info*>& planned, int32_t need, bool started) {
  std::ostringstream why;
  const auto have = static_cast<int32_t>(planned.size());
  if (started)
    why << "waiting for nodes: " << have << " node" << (have == 1 ? "" : "s") << " with a ready rank, below the floor of " << need << " (cluster.floor_nodes)";
  else
    why << "waiting for " << need << " node" << (need == 1 ? "" : "s") << " (cluster.min_nodes), have " << have;
  if (have > 0) why << " " << join_some(ids_of(planned));
  std::vector<node_id> standbys;
  for (const auto& [id, n] : s.nodes)
    if (has_ready(n) && waits_as_standby(s, n)) standbys.push_back(id);
  if (!standbys.empty()) why << "; standby (--standby-node, not counted): " << join_some(standbys);
  if (auto idle = node_ids(s, false); !idle.empty()) why << "; no ready rank yet: " << join_some(idle);
  return why.str();
}

std::string describe(const plan& p, size_t ready_nodes, const std::vector<node_id>& ids) {
  std::ostringstream why;
  why << "generation " << p.generation << ": " << ready_nodes << " node" << (ready_nodes == 1 ? "" : "s") << " " << join(ids) << ", world size "
      << p.world_size << ", cause " << to_string(p.cause);
  if (p.cause == plan_cause::start) return why.str();  // nothing to drain or abort, no state held yet
  why << (p.drain ? ", drain" : ", abort");
  if (p.state_root >= 0)
    why << ", state from global rank " << p.state_root;
  else
    why << ", no surviving state holder (the newest checkpoint, if any)";
  if (!p.promoted.empty()) why << ", standby promoted: " << join(p.promoted);
  return why.str();
}

}  // namespace

std::string validate(const membership_options& o) {
  if (o.floor_nodes > o.min_nodes)
    return "cluster.floor_nodes (" + std::to_string(o.floor_nodes) + ") cannot exceed cluster.min_nodes (" + std::to_string(o.min_nodes) +
           "): the job would start below its own floor";
  if (o.min_nodes > o.max_nodes)
    return "cluster.min_nodes (" + std::to_string(o.min_nodes) + ") cannot exceed cluster.max_nodes (" + std::to_string(o.max_nodes) +
           "): the job would never start";
  return {};
}

void group_ranks_by_node(plan& p) {
  std::sort(p.ranks.begin(), p.ranks.end(), [](const rank_slot& a, const rank_slot& b) { return a.global_rank < b.global_rank; });
  p.nodes.clear();
  for (const auto& r : p.ranks) {
    if (p.nodes.empty() || p.nodes.back().node_id != r.node_id) {
      plan_node n;
      n.node_id = r.node_id;
      n.first_global_rank = r.global_rank;
      p.nodes.push_back(std::move(n));
    }
    p.nodes.back().local_ranks.push_back(r.local_rank);
    p.nodes.back().nproc = static_cast<int32_t>(p.nodes.back().local_ranks.size());
  }
}

void merge_slice(plan& into, const plan& slice) {
  // Both keep their ranks in global rank order, each node's consecutive: a
  // node's ranks go in as one block where they belong (a binary search),
  // unless some of them are held already (a registration said twice).
  size_t offset = 0;
  for (const auto& n : slice.nodes) {
    const size_t count = n.local_ranks.size();
    const int32_t first = n.first_global_rank, end = first + static_cast<int32_t>(count);
    const auto from = slice.ranks.begin() + static_cast<std::ptrdiff_t>(offset);
    offset += count;
    if (first < 0 || end > into.world_size || offset > slice.ranks.size()) continue;
    auto at = std::lower_bound(into.ranks.begin(), into.ranks.end(), first, [](const rank_slot& r, int32_t g) { return r.global_rank < g; });
    if (at != into.ranks.end() && at->global_rank < end) continue;
    into.ranks.insert(at, from, from + static_cast<std::ptrdiff_t>(count));
    auto node_at = std::lower_bound(into.nodes.begin(), into.nodes.end(), first, [](const plan_node& x, int32_t g) { return x.first_global_rank < g; });
    into.nodes.insert(node_at, n);
  }
}

const plan_node* plan::find(const node_id& id) const {
  for (const auto& n : nodes)
    if (n.node_id == id) return &n;
  return nullptr;
}

const rank_slot* plan::find(const node_id& id, int32_t local_rank) const {
  for (const auto& r : ranks)
    if (r.node_id == id && r.local_rank == local_rank) return &r;
  return nullptr;
}

plan make_plan(const membership_state& state, uint64_t generation, const membership_options& opts) {
  plan p;
  p.generation = generation;
  p.drain = can_drain(state);
  p.cause = cause_of_next(state);
  int32_t global = 0;
  const auto planned = planned_nodes(state, opts);
  p.promoted = promoted_standbys(state, planned, opts);
  for (const auto* n : planned) {
    plan_node pn{n->node_id, n->advertise_addr, n->peer, n->node_rank, n->nproc, global, n->incarnation, {}};
    for (const auto& [l, serial] : n->ready) {
      rank_slot r{n->node_id, l, global++, serial};
      if (p.state_root < 0 && state.current && state.current->find(n->node_id, l) &&
          still_ready(state, *state.current, *state.current->find(n->node_id, l)) &&
          (state.current->adopted || holds_state_of(*n, l, state.current->generation)))
        p.state_root = r.global_rank;
      pn.local_ranks.push_back(l);
      p.ranks.push_back(std::move(r));
    }
    p.nodes.push_back(std::move(pn));
  }
  p.world_size = global;
  for (const auto& [id, n] : state.leaving) p.leaving.push_back(n);
  return p;
}

plan_decision decide(clock_time now, const membership_state& state, const membership_options& opts) {
  plan_decision d;
  std::ostringstream why;
  if (!state.current && state.reported_plan) {
    auto gap = adoption_gap(state);
    if (gap.empty()) {
      d.next = adopted_plan(state);
      why << "adopting generation " << d.next->generation << " from its nodes (world size " << d.next->world_size << ")";
      d.reason = why.str();
      return d;
    }
    auto waited = state.first_registration ? now - *state.first_registration : clock_duration{0};
    if (waited < opts.adopt_timeout) {
      why << "waiting up to " << seconds(opts.adopt_timeout) << " s to adopt generation " << state.reported_plan->generation << ": " << gap;
      d.reason = why.str();
      return d;
    }
  }
  const auto planned = planned_nodes(state, opts);
  const auto have = static_cast<int32_t>(planned.size());
  // Before the first generation the job waits for min_nodes (the start gate);
  // once it has trained (here or, after a coordinator restart, under an
  // earlier coordinator) it goes on with as few as floor_nodes.
  const bool started = state.current.has_value() || state.last_generation > 0;
  const int32_t need = started ? opts.floor_nodes : opts.min_nodes;
  if (have < need || have == 0) {
    d.below_floor = started;
    d.reason = waiting_reason(state, planned, need, started);
    return d;
  }
  if (state.current && same_members(*state.current, state, opts)) {
    if (!state.suspect_since || now - *state.suspect_since < opts.suspect_timeout) {
      const auto in_world = state.current->nodes.size(), ready = node_ids(state, true).size();
      why << "generation " << state.current->generation << " is current: " << in_world << " node" << (in_world == 1 ? "" : "s") << ", world size "
          << state.current->world_size;
      if (ready > in_world) why << "; " << ready - in_world << " standby waiting";
      if (state.suspect_since) why << "; a collective failed, waiting up to " << seconds(opts.suspect_timeout) << " s for a membership change";
      d.reason = why.str();
      return d;
    }
  } else if (state.settling_since && !state.loss_pending && !full(state, opts) && !refills_places(state, planned)) {
    auto since = now - *state.settling_since;
    if (since < opts.settle) {
      why << "nodes or ranks joined; settling for " << seconds(opts.settle) << " s before planning with " << have << " node" << (have == 1 ? "" : "s")
          << " " << join(ids_of(planned));
      d.reason = why.str();
      d.settles_at = *state.settling_since + opts.settle;
      return d;
    }
  }
  d.next = make_plan(state, std::max(state.last_generation, opts.generations_after) + 1, opts);
  std::vector<node_id> planned_ids;
  for (const auto& n : d.next->nodes) planned_ids.push_back(n.node_id);
  std::sort(planned_ids.begin(), planned_ids.end());
  d.reason = describe(*d.next, planned_ids.size(), planned_ids);
  return d;
}

std::set<node_id> waiting_standbys(const membership_state& state, const membership_options& opts) {
  const auto planned = planned_nodes(state, opts);
  std::set<node_id> out;
  for (const auto& [id, n] : state.nodes)
    if (!in_plan(state, n) && (waits_as_standby(state, n) || (has_ready(n) && std::find(planned.begin(), planned.end(), &n) == planned.end())))
      out.insert(id);
  return out;
}

}  // namespace dtactor
