#include "actors/relays.hpp"

#include <algorithm>

namespace dtactor {

void relay_directory::set(const node_id& id, int32_t rank, const std::string& endpoint) {
  erase(id);
  if (endpoint.empty() || rank < 0) return;
  // Two members never hold one rank; a stale holder of it gives way.
  if (auto it = by_rank_.find(rank); it != by_rank_.end()) known_.erase(it->second);
  by_rank_[rank] = id;
  known_[id] = {rank, endpoint};
}

void relay_directory::erase(const node_id& id) {
  auto it = known_.find(id);
  if (it == known_.end()) return;
  by_rank_.erase(it->second.first);
  known_.erase(it);
}

void relay_directory::clear() {
  by_rank_.clear();
  known_.clear();
}

void relay_directory::update(size_t members) {
  if (o_.from_nodes <= 0 || o_.group_size <= 1) {
    on_ = false;
    return;
  }
  const auto on_at = static_cast<size_t>(o_.from_nodes);
  on_ = on_ ? members >= on_at - on_at / 4 : members >= on_at;
}

std::optional<relay_directory::relay> relay_directory::relay_for(int32_t rank, const still_member& valid) {
  if (!on_ || rank < 0) return std::nullopt;
  const int32_t first = rank / o_.group_size * o_.group_size;
  for (auto it = by_rank_.lower_bound(first); it != by_rank_.end() && it->first < first + o_.group_size;) {
    const auto& k = known_.at(it->second);
    if (valid(it->second, it->first)) return relay{it->second, k.second};
    known_.erase(it->second);
    it = by_rank_.erase(it);
  }
  return std::nullopt;
}

void relay_directory::renumber(const std::function<int32_t(const node_id&)>& rank_of) {
  auto known = std::move(known_);
  clear();
  for (const auto& [id, k] : known) set(id, rank_of(id), k.second);
}

size_t relay_directory::direct_beaters(size_t members) const {
  if (!on_) return members;
  const auto s = static_cast<size_t>(o_.group_size);
  return (members + s - 1) / s;
}

pb::relay_assignment to_proto(const std::optional<relay_directory::relay>& r, uint32_t member_interval_ms) {
  pb::relay_assignment a;
  if (!r) return a;
  a.set_endpoint(r->endpoint);
  a.set_node_id(r->id.str());
  a.set_interval_ms(member_interval_ms);
  return a;
}

void relay_hub::heard(const std::string& node_id, const beat& b) {
  auto it = beats_.find(node_id);
  if (it != beats_.end()) {
    if (b.heard >= it->second.heard) it->second = b;
    return;
  }
  if (capacity_ > 0 && beats_.size() >= capacity_) {
    auto stalest = std::min_element(beats_.begin(), beats_.end(), [](const auto& a, const auto& c) { return a.second.heard < c.second.heard; });
    beats_.erase(stalest);
  }
  beats_.emplace(node_id, b);
}

void relay_hub::fill(pb::heartbeat& hb, clock_time now, clock_duration timeout) {
  for (auto it = beats_.begin(); it != beats_.end();) {
    const auto age = now - std::min(now, it->second.heard);
    if (age >= timeout) {
      it = beats_.erase(it);
      continue;
    }
    auto* r = hb.add_relayed();
    r->set_node_id(it->first);
    r->set_incarnation(it->second.incarnation);
    r->set_generation(it->second.generation);
    r->set_step(it->second.step);
    r->set_age_ms(static_cast<uint32_t>(std::chrono::duration_cast<std::chrono::milliseconds>(age).count()));
    ++it;
  }
}

void relay_hub::refuse(const std::vector<std::string>& ids) {
  for (const auto& id : ids) {
    beats_.erase(id);
    if (refused_.size() < std::max<size_t>(capacity_, 1)) refused_.insert(id);
  }
}

bool relay_hub::take_refusal(const std::string& node_id) { return refused_.erase(node_id) > 0; }

std::optional<std::string> relay_link::assign(const pb::relay_assignment& a, const std::string& self, clock_time now) {
  member_interval_ = std::chrono::milliseconds(a.interval_ms());
  for (auto it = avoided_.begin(); it != avoided_.end();) it = it->second <= now ? avoided_.erase(it) : std::next(it);
  is_relay_ = !a.endpoint().empty() && a.node_id() == self;
  std::string want = a.endpoint().empty() || is_relay_ || avoided_.count(a.endpoint()) ? std::string() : a.endpoint();
  if (want == endpoint_) return std::nullopt;
  endpoint_ = want;
  relay_id_ = want.empty() ? std::string() : a.node_id();
  acked_.reset();
  unanswered_since_.reset();
  return want;
}

void relay_link::beat(clock_time now) {
  if (!unanswered_since_) unanswered_since_ = now;
}

bool relay_link::given_up(clock_time now, clock_duration grace, clock_duration first_grace, clock_duration avoid_for) {
  if (endpoint_.empty() || !unanswered_since_ || now - *unanswered_since_ < (acked_ ? grace : first_grace)) return false;
  avoided_[endpoint_] = now + avoid_for;
  endpoint_.clear();
  relay_id_.clear();
  unanswered_since_.reset();
  return true;
}

void relay_link::reset() {
  endpoint_.clear();
  relay_id_.clear();
  is_relay_ = false;
  acked_.reset();
  unanswered_since_.reset();
}

}  // namespace dtactor
