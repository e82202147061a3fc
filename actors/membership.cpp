#include "actors/membership.hpp"

#include <algorithm>
#include <set>
#include <sstream>

namespace dtactor {

namespace {

std::string node_list(const membership_state& s) {
  std::string out = "[";
  for (const auto& [id, n] : s.nodes) {
    if (out.size() > 1) out += ", ";
    out += id;
  }
  return out + "]";
}

bool same_members(const plan& p, const membership_state& s) {
  if (p.nodes.size() != s.nodes.size()) return false;
  for (const auto& pn : p.nodes) {
    auto it = s.nodes.find(pn.node_id);
    if (it == s.nodes.end()) return false;
    const auto& n = it->second;
    if (n.incarnation != pn.incarnation || n.nproc != pn.nproc || n.node_rank != pn.node_rank || n.advertise_addr != pn.advertise_addr) return false;
  }
  return true;
}

double seconds(clock_duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

const plan_node* plan::find(const std::string& node_id) const {
  for (const auto& n : nodes)
    if (n.node_id == node_id) return &n;
  return nullptr;
}

plan make_plan(const membership_state& state, uint64_t generation) {
  plan p;
  p.generation = generation;
  std::vector<const node_info*> order;
  for (const auto& [id, n] : state.nodes) order.push_back(&n);
  std::sort(order.begin(), order.end(), [](const node_info* a, const node_info* b) {
    return a->node_rank != b->node_rank ? a->node_rank < b->node_rank : a->node_id < b->node_id;
  });
  int32_t global = 0;
  for (const auto* n : order) {
    p.nodes.push_back(plan_node{n->node_id, n->advertise_addr, n->peer, n->node_rank, n->nproc, global, n->incarnation});
    bool survivor = false;
    if (state.current) {
      const auto* prev = state.current->find(n->node_id);
      survivor = prev && prev->incarnation == n->incarnation;
    }
    if (survivor && p.state_root < 0) p.state_root = global;
    for (int32_t l = 0; l < n->nproc; ++l) p.ranks.push_back(rank_slot{n->node_id, l, global++});
  }
  p.world_size = global;
  return p;
}

plan_decision decide(clock_time now, const membership_state& state, const membership_options& opts) {
  plan_decision d;
  auto have = static_cast<int32_t>(state.nodes.size());
  std::ostringstream why;
  if (have < opts.min_nodes) {
    why << "waiting for " << opts.min_nodes << " node" << (opts.min_nodes == 1 ? "" : "s") << " (cluster.min_nodes), have " << have;
    if (have > 0) why << " " << node_list(state);
    if (state.current) why << "; generation " << state.current->generation << " is below quorum";
    d.reason = why.str();
    return d;
  }
  if (state.current && same_members(*state.current, state)) {
    why << "generation " << state.current->generation << " is current: " << have << " node" << (have == 1 ? "" : "s") << ", world size "
        << state.current->world_size;
    d.reason = why.str();
    return d;
  }
  auto since = now - state.last_change;
  if (opts.settle.count() > 0 && since < opts.settle && have < opts.max_nodes) {
    why << "membership changed " << seconds(since) << " s ago; settling for " << seconds(opts.settle) << " s before planning with " << have
        << " nodes " << node_list(state);
    d.reason = why.str();
    return d;
  }
  d.next = make_plan(state, state.last_generation + 1);
  why << "generation " << d.next->generation << ": " << have << " node" << (have == 1 ? "" : "s") << " " << node_list(state) << ", world size "
      << d.next->world_size;
  if (d.next->state_root >= 0)
    why << ", state from global rank " << d.next->state_root;
  else
    why << ", no surviving state holder";
  d.reason = why.str();
  return d;
}

membership::membership(membership_options opts) : opts_(opts) {}

int32_t membership::assign_rank(const std::string& node_id) {
  std::set<int32_t> held;
  for (const auto& [id, n] : state_.nodes)
    if (id != node_id) held.insert(n.node_rank);
  auto mine = state_.remembered_ranks.find(node_id);
  if (mine != state_.remembered_ranks.end() && !held.count(mine->second)) return mine->second;
  std::map<int32_t, std::string> reserved;  // rank -> departed node that last held it
  for (const auto& [id, r] : state_.remembered_ranks)
    if (id != node_id && !state_.nodes.count(id)) reserved[r] = id;
  for (int32_t r = 0; r < opts_.max_nodes; ++r)
    if (!held.count(r) && !reserved.count(r)) return r;
  // Every free rank below max_nodes is claimed by a departed node: take the
  // lowest and forget that claim.
  for (int32_t r = 0;; ++r) {
    if (held.count(r)) continue;
    auto it = reserved.find(r);
    if (it != reserved.end()) state_.remembered_ranks.erase(it->second);
    return r;
  }
}

admission membership::admit(const node_registration& reg, clock_time now) {
  admission a;
  if (reg.node_id.empty()) {
    a.reason = "register_node without a node_id; every node needs a stable id (--node-id or its hostname)";
    return a;
  }
  if (reg.nproc < 1) {
    a.reason = "node '" + reg.node_id + "' registered with nproc " + std::to_string(reg.nproc) + "; it must run at least one rank";
    return a;
  }
  auto it = state_.nodes.find(reg.node_id);
  if (it != state_.nodes.end()) {
    auto& n = it->second;
    a.changed = n.incarnation != reg.incarnation || n.nproc != reg.nproc || n.advertise_addr != reg.advertise_addr;
    n.peer = reg.peer;
    n.last_seen = now;
    if (a.changed) {
      n.incarnation = reg.incarnation;
      n.nproc = reg.nproc;
      n.advertise_addr = reg.advertise_addr;
      n.joined = now;
      state_.last_change = now;
    }
    a.accepted = true;
    a.node_rank = n.node_rank;
    a.rejoined = true;
    return a;
  }
  auto members = static_cast<int32_t>(state_.nodes.size());
  if (members >= opts_.max_nodes) {
    a.reason = "cluster is full: " + std::to_string(members) + " nodes are members and cluster.max_nodes is " + std::to_string(opts_.max_nodes) +
               "; node '" + reg.node_id + "' was not admitted (raise cluster.max_nodes or stop a node)";
    return a;
  }
  auto remembered = state_.remembered_ranks.find(reg.node_id);
  int32_t rank = assign_rank(reg.node_id);
  a.rejoined = remembered != state_.remembered_ranks.end() && remembered->second == rank;
  state_.remembered_ranks[reg.node_id] = rank;
  state_.nodes[reg.node_id] = node_info{reg.node_id, reg.advertise_addr, reg.peer, reg.nproc, rank, reg.incarnation, now, now};
  state_.last_change = now;
  a.accepted = true;
  a.changed = true;
  a.node_rank = rank;
  return a;
}

bool membership::remove(const std::string& node_id, clock_time now) {
  if (state_.nodes.erase(node_id) == 0) return false;
  state_.last_change = now;
  return true;
}

bool membership::touch(const std::string& node_id, uint64_t incarnation, clock_time now, const std::string& peer) {
  auto it = state_.nodes.find(node_id);
  if (it == state_.nodes.end() || it->second.incarnation != incarnation) return false;
  if (!peer.empty()) it->second.peer = peer;
  it->second.last_seen = std::max(it->second.last_seen, now);
  return true;
}

const plan& membership::commit(plan p) {
  state_.last_generation = std::max(state_.last_generation, p.generation);
  state_.current = std::move(p);
  return *state_.current;
}

std::map<std::string, clock_time> membership::last_seen() const {
  std::map<std::string, clock_time> out;
  for (const auto& [id, n] : state_.nodes) out[id] = n.last_seen;
  return out;
}

const node_info* membership::find(const std::string& node_id) const {
  auto it = state_.nodes.find(node_id);
  return it == state_.nodes.end() ? nullptr : &it->second;
}

}  // namespace dtactor
