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

std::string seconds_text(clock_duration d) {
  std::ostringstream out;
  out << seconds(d);
  return out.str();
}

// Lower is more severe: a plan's cause is the most severe change since the
// last (node_lost .. rank_ready, in the enum's order); nothing noted is
// the least severe.
int severity(plan_cause cause) {
  const int v = static_cast<int>(cause);
  return cause == plan_cause::none || v > static_cast<int>(plan_cause::rank_ready) ? 1000 : v;
}

}  // namespace

membership::membership(membership_options opts) : opts_(opts) {}

void rank_use::add(int32_t r) {
  if (r < 0) return;
  if (static_cast<size_t>(r) >= count_.size()) {
    for (auto i = static_cast<int32_t>(count_.size()); i < r; ++i) free_.insert(i);
    count_.resize(static_cast<size_t>(r) + 1, 0);
  }
  if (count_[static_cast<size_t>(r)]++ == 0) free_.erase(r);
}

void rank_use::remove(int32_t r) {
  if (r < 0 || static_cast<size_t>(r) >= count_.size() || count_[static_cast<size_t>(r)] == 0) return;
  if (--count_[static_cast<size_t>(r)] == 0) free_.insert(r);
}

bool rank_use::held(int32_t r) const { return r >= 0 && static_cast<size_t>(r) < count_.size() && count_[static_cast<size_t>(r)] > 0; }

int32_t rank_use::lowest_free() const { return free_.empty() ? static_cast<int32_t>(count_.size()) : *free_.begin(); }

int32_t rank_use::free_after(int32_t r) const {
  auto it = free_.upper_bound(r);
  return it != free_.end() ? *it : std::max(r + 1, static_cast<int32_t>(count_.size()));
}

void rank_use::clear() {
  count_.clear();
  free_.clear();
}

std::map<int32_t, node_id> membership::departed_claims(const node_id& id) const {
  std::map<int32_t, node_id> out;
  const auto& remembered = state_.remembered_ranks;
  const size_t own = remembered.count(id);
  if (remembered.size() == state_.nodes.size() + own) return out;  // every member is remembered (join_node, commit): none departed
  // Both maps are ordered by node id: one walk.
  auto member = state_.nodes.begin();
  for (const auto& [other, r] : remembered) {
    while (member != state_.nodes.end() && member->first < other) ++member;
    const bool is_member = member != state_.nodes.end() && member->first == other;
    if (other != id && !is_member) out[r] = other;
  }
  return out;
}

int32_t membership::assign_rank(const node_id& id) {
  // `id` is no member here (admit removed an older process of it).
  auto mine = state_.remembered_ranks.find(id);
  if (mine != state_.remembered_ranks.end() && !ranks_.held(mine->second)) return mine->second;
  const auto reserved = departed_claims(id);  // rank -> departed node that last held it
  for (int32_t r = ranks_.lowest_free(); r < opts_.max_nodes + opts_.standby_nodes; r = ranks_.free_after(r))
    if (!reserved.count(r)) return r;
  // Every free rank below max_nodes is claimed by a departed node: take the
  // lowest and forget that claim.
  const int32_t r = ranks_.lowest_free();
  auto it = reserved.find(r);
  if (it != reserved.end()) state_.remembered_ranks.erase(it->second);
  return r;
}

void membership::erase_member(std::map<node_id, node_info>::iterator it) {
  ranks_.remove(it->second.node_rank);
  state_.nodes.erase(it);
}

bool membership::in_current(const node_id& id, uint64_t incarnation) const {
  if (!state_.current) return false;
  const auto* pn = state_.current->find(id);
  return pn && pn->incarnation == incarnation;
}

void membership::note_addition(plan_cause cause, clock_time now) {
  state_.last_change = now;
  state_.settling_since = now;
  if (severity(cause) < severity(state_.pending_cause)) state_.pending_cause = cause;
}

void membership::note_loss(plan_cause cause, bool in_plan, clock_time now) {
  state_.last_change = now;
  // Only a loss of the running generation is urgent (and names the next plan).
  if (!in_plan) return;
  state_.loss_pending = true;
  if (severity(cause) < severity(state_.pending_cause)) state_.pending_cause = cause;
}

bool membership::note_failure(const node_id& id, clock_time now) {
  auto& f = state_.flaps[id];
  f.failures.erase(std::remove_if(f.failures.begin(), f.failures.end(), [&](clock_time t) { return now - t >= opts_.flap_window; }),
                   f.failures.end());
  f.failures.push_back(now);
  if (static_cast<int32_t>(f.failures.size()) < opts_.flap_max_failures) return false;
  clock_duration length = opts_.quarantine;
  for (int32_t i = 0; i < f.quarantines && length < opts_.quarantine_max; ++i) length *= 2;
  length = std::min(length, opts_.quarantine_max);
  ++f.quarantines;
  f.until = now + length;
  f.reason = "node '" + id.str() + "' is quarantined for " + seconds_text(length) + " s after " + std::to_string(f.failures.size()) + " failures in " +
             seconds_text(opts_.flap_window) + " s (flapping)";
  f.failures.clear();
  return true;
}

std::string membership::quarantine_reason(const node_id& id, clock_time now) const {
  auto it = state_.flaps.find(id);
  if (it == state_.flaps.end() || !it->second.until || now >= *it->second.until) return {};
  return it->second.reason + "; " + seconds_text(*it->second.until - now) + " s left";
}

bool membership::mark_ready(node_info& n, int32_t local_rank, bool ready, clock_time now) {
  if (local_rank < 0 || local_rank >= n.nproc) return false;
  bool planned = state_.current && state_.current->find(n.node_id, local_rank) && in_current(n.node_id, n.incarnation);
  if (ready) {
    if (n.ready.count(local_rank)) return false;
    n.ready[local_rank] = ++state_.last_serial;
    note_addition(in_current(n.node_id, n.incarnation) ? plan_cause::rank_ready : plan_cause::node_joined, now);
    return true;
  }
  if (!n.ready.erase(local_rank)) return false;
  note_loss(plan_cause::rank_exited, planned, now);
  return true;
}

bool membership::set_rank_ready(const node_id& id, uint64_t incarnation, int32_t local_rank, bool ready, clock_time now) {
  auto it = state_.nodes.find(id);
  if (it == state_.nodes.end() || it->second.incarnation != incarnation) return false;
  return mark_ready(it->second, local_rank, ready, now);
}

void membership::note_synced(const node_id& id, uint64_t incarnation, int32_t local_rank, uint64_t generation) {
  auto it = state_.nodes.find(id);
  if (it == state_.nodes.end() || it->second.incarnation != incarnation) return;
  auto r = it->second.ready.find(local_rank);
  if (r == it->second.ready.end()) return;
  auto& s = it->second.synced[local_rank];
  if (s.first != r->second) s = {r->second, 0};
  s.second = std::max(s.second, generation);
}

bool membership::report_failure(uint64_t generation, const node_id& id, int32_t local_rank, clock_time now) {
  if (!state_.current || state_.current->generation != generation || state_.suspect_since) return false;
  if (!state_.current->find(id, local_rank)) return false;
  state_.suspect_since = now;
  return true;
}

std::string node_id_problem(const std::string& id) {
  if (id.empty()) return "an empty node id";
  bool bad = id.size() > 128;
  for (size_t i = 0; i < id.size() && !bad; ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    bad = !(std::isalnum(c) || c == '.' || c == '_' || c == '-');
  }
  if (!bad) return "";
  return "node id '" + printable(id, 64) + "' is not 1 to 128 letters, digits, '.', '_' or '-'";
}

namespace {

// Why a registration cannot be admitted whatever the state ("" when it can):
// no id, a malformed id, no ranks or more than `max_ranks_per_node`.
std::string registration_problem(const node_registration& reg, int32_t max_ranks_per_node) {
  if (reg.node_id.empty()) return "register_node without a node_id; every node needs a stable id (--node-id or its hostname)";
  if (auto why = node_id_problem(reg.node_id.str()); !why.empty()) return "register_node refused: " + why;
  if (reg.nproc < 1) return "node '" + reg.node_id.str() + "' registered with nproc " + std::to_string(reg.nproc) + "; it must run at least one rank";
  if (reg.nproc > max_ranks_per_node)
    return "node '" + reg.node_id.str() + "' registered with nproc " + std::to_string(reg.nproc) + ", more than cluster.max_ranks_per_node (" +
           std::to_string(max_ranks_per_node) + "); start it with fewer ranks (--nproc-per-node) or raise the limit";
  return "";
}

// Why a registration beyond max_nodes + standby_nodes is refused. A node
// started with --standby-node counts like any other: the limit bounds what
// the coordinator holds, whoever registers.
std::string full_reason(int32_t members, const node_registration& reg, const membership_options& o) {
  std::string limit = "cluster.max_nodes is " + std::to_string(o.max_nodes);
  if (o.standby_nodes > 0) limit += " and cluster.standby_nodes is " + std::to_string(o.standby_nodes);
  const std::string what = reg.standby ? "standby node '" + reg.node_id.str() + "' (--standby-node) was not admitted (raise cluster.standby_nodes"
                                       : "node '" + reg.node_id.str() + "' was not admitted (raise cluster.max_nodes";
  return "cluster is full: " + std::to_string(members) + " nodes are members and " + limit + "; " + what + " or stop a node)";
}

}  // namespace

admission membership::admit(const node_registration& reg, clock_time now) {
  admission a;
  if (auto why = registration_problem(reg, opts_.max_ranks_per_node); !why.empty()) {
    a.reason = why;
    return a;
  }
  if (auto q = quarantine_reason(reg.node_id, now); !q.empty()) {
    a.quarantined = true;
    a.reason = q;
    return a;
  }
  adopt_reported(reg, now);
  const std::set<int32_t> ready(reg.ready_ranks.begin(), reg.ready_ranks.end());
  auto it = state_.nodes.find(reg.node_id);
  if (it != state_.nodes.end() && it->second.incarnation == reg.incarnation && it->second.nproc == reg.nproc)
    return readmit(it->second, reg, ready, now);
  if (it != state_.nodes.end() && it->second.incarnation != reg.incarnation && now - it->second.last_seen < opts_.duplicate_window) {
    // The member's process is alive (heard from just now): this is a second
    // process under the same id (a machine cloned from one image, two nodes
    // on one host), not a restart. Taking it for a restart would throw the
    // live member out, and each would keep evicting the other.
    std::ostringstream why;
    why << "node id '" << reg.node_id.str() << "' is in use by a live node (at " << it->second.advertise_addr
        << "); give every node its own --node-id (a machine cloned from another keeps its host name)";
    a.duplicate = true;
    a.reason = why.str();
    return a;
  }
  if (it != state_.nodes.end()) {
    // Same id, new process (or the same process with another nproc): the
    // old ranks are gone. Only a new process counts towards flapping.
    a.restarted = it->second.incarnation != reg.incarnation;
    a.silent_s = seconds(now - std::min(now, it->second.last_seen));
    note_loss(plan_cause::node_lost, in_current(reg.node_id, it->second.incarnation), now);
    erase_member(it);
    if (a.restarted && note_failure(reg.node_id, now)) {
      a.quarantined = true;
      a.changed = true;
      a.reason = quarantine_reason(reg.node_id, now);
      return a;
    }
  } else if (auto members = static_cast<int32_t>(state_.nodes.size()); members >= opts_.max_nodes + opts_.standby_nodes) {
    a.reason = full_reason(members, reg, opts_);
    return a;
  }
  join_node(reg, ready, now, a);
  return a;
}

void membership::adopt_reported(const node_registration& reg, clock_time now) {
  state_.last_generation = std::max(state_.last_generation, reg.last_generation);
  if (state_.current) return;
  if (!state_.first_registration) state_.first_registration = now;
  if (reg.current_plan) {
    state_.last_generation = std::max(state_.last_generation, reg.current_plan->generation);
    if (!state_.reported_plan || reg.current_plan->generation > state_.reported_plan->generation)
      state_.reported_plan = reg.current_plan;
    else if (reg.current_plan->generation == state_.reported_plan->generation)
      merge_slice(*state_.reported_plan, *reg.current_plan);
  }
}

admission membership::readmit(node_info& n, const node_registration& reg, const std::set<int32_t>& ready, clock_time now) {
  admission a;
  n.peer = reg.peer;
  n.last_seen = std::max(n.last_seen, now);
  n.closed.reset();
  n.plan_generation = reg.current_plan ? reg.current_plan->generation : 0;
  if (n.advertise_addr != reg.advertise_addr) {
    n.advertise_addr = reg.advertise_addr;
    note_addition(plan_cause::node_joined, now);
    a.changed = true;
  }
  std::vector<int32_t> gone;
  for (const auto& [l, serial] : n.ready)
    if (!ready.count(l)) gone.push_back(l);
  for (int32_t l : gone) a.changed |= mark_ready(n, l, false, now);
  for (int32_t l : ready) a.changed |= mark_ready(n, l, true, now);
  a.accepted = true;
  a.node_rank = n.node_rank;
  a.rejoined = true;
  return a;
}

void membership::join_node(const node_registration& reg, const std::set<int32_t>& ready, clock_time now, admission& a) {
  const node_id& id = reg.node_id;
  state_.leaving.erase(id);
  auto remembered = state_.remembered_ranks.find(id);
  int32_t rank = assign_rank(id);
  a.rejoined = remembered != state_.remembered_ranks.end() && remembered->second == rank;
  state_.remembered_ranks[id] = rank;
  const uint64_t plan_generation = reg.current_plan ? reg.current_plan->generation : 0;
  auto& n = state_.nodes[id] =
      node_info{reg.node_id, reg.advertise_addr, reg.peer, reg.nproc, rank, reg.incarnation, now, now, std::nullopt, {}, plan_generation, {}, reg.standby};
  ranks_.add(rank);
  note_addition(plan_cause::node_joined, now);
  for (int32_t l : ready) mark_ready(n, l, true, now);
  a.accepted = true;
  a.changed = true;
  a.joined = true;
  a.node_rank = rank;
}

removal membership::remove(const node_id& id, clock_time now, departure why) {
  removal r;
  auto it = state_.nodes.find(id);
  if (it == state_.nodes.end()) return r;
  const bool planned = in_current(id, it->second.incarnation);
  if (why == departure::left) {
    if (planned) {
      auto& leaving = state_.leaving[id] = *state_.current->find(id);
      leaving.peer = it->second.peer;  // where it is reachable now
    }
    note_loss(plan_cause::node_left, planned, now);
  } else {
    note_loss(plan_cause::node_lost, planned, now);
  }
  erase_member(it);
  r.removed = true;
  if (why == departure::lost && note_failure(id, now)) {
    r.quarantined = true;
    r.reason = state_.flaps[id].reason;
  }
  return r;
}

bool membership::touch(const node_id& id, uint64_t incarnation, clock_time now, const std::string& peer) {
  auto it = state_.nodes.find(id);
  if (it == state_.nodes.end() || it->second.incarnation != incarnation) return false;
  if (!peer.empty()) it->second.peer = peer;
  it->second.last_seen = std::max(it->second.last_seen, now);
  it->second.closed.reset();
  return true;
}

bool membership::sighted(const node_id& id, uint64_t incarnation, clock_time seen_at, clock_duration after_close) {
  auto it = state_.nodes.find(id);
  if (it == state_.nodes.end() || it->second.incarnation != incarnation) return false;
  it->second.last_seen = std::max(it->second.last_seen, seen_at);
  if (it->second.closed && seen_at > *it->second.closed + after_close) it->second.closed.reset();
  return true;
}

node_id membership::connection_closed(const std::string& peer, clock_time now) {
  for (auto& [id, n] : state_.nodes) {
    if (n.peer != peer) continue;
    if (!n.closed) n.closed = now;
    return id;
  }
  return {};
}

std::map<node_id, clock_time> membership::closed() const {
  std::map<node_id, clock_time> out;
  for (const auto& [id, n] : state_.nodes)
    if (n.closed) out[id] = *n.closed;
  return out;
}

const plan& membership::commit(plan p) {
  state_.last_generation = std::max(state_.last_generation, p.generation);
  if (p.adopted) {
    // Node ranks follow the adopted plan's global rank order; other members
    // move to free ranks after them.
    std::set<int32_t> held;
    for (const auto& pn : p.nodes) {
      state_.nodes.at(pn.node_id).node_rank = pn.node_rank;
      state_.remembered_ranks[pn.node_id] = pn.node_rank;
      held.insert(pn.node_rank);
    }
    for (auto& [id, n] : state_.nodes) {
      if (p.find(id)) continue;
      int32_t r = 0;
      while (held.count(r)) ++r;
      n.node_rank = r;
      state_.remembered_ranks[id] = r;
      held.insert(r);
    }
    ranks_.clear();
    for (const auto& [id, n] : state_.nodes) ranks_.add(n.node_rank);
  }
  if (!p.adopted) {
    state_.settling_since.reset();
    state_.pending_cause = plan_cause::none;
  } else {
    // Members outside the adopted plan join it as usual, after settling.
    state_.pending_cause = plan_cause::node_joined;
  }
  state_.loss_pending = false;
  state_.leaving.clear();
  state_.suspect_since.reset();
  state_.reported_plan.reset();
  state_.peak_world = std::max(state_.peak_world, p.world_size);
  state_.current = std::move(p);
  return *state_.current;
}

void membership::credit_pause(clock_duration pause, clock_time now) {
  for (auto& [id, n] : state_.nodes) {
    n.last_seen = dtactor::credit_pause(n.last_seen, pause, now);
    if (n.closed) n.closed = dtactor::credit_pause(*n.closed, pause, now);
  }
}

std::map<node_id, clock_time> membership::last_seen() const {
  std::map<node_id, clock_time> out;
  for (const auto& [id, n] : state_.nodes) out[id] = n.last_seen;
  return out;
}

const node_info* membership::find(const node_id& id) const {
  auto it = state_.nodes.find(id);
  return it == state_.nodes.end() ? nullptr : &it->second;
}

}  // namespace dtactor
