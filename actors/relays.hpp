#pragma once
// Heartbeat relays: the coordinator's load grows with the number of relay
// groups, not of nodes.
//
// From cluster.relay_from_nodes members on, nodes are grouped by node rank,
// cluster.relay_group_size a group (ranks [g*S, (g+1)*S)). The member of a
// group with the lowest node rank that listens for relayed beats (its
// register_node.relay_endpoint) is the group's relay:
//   - the others beat the relay instead of the coordinator, at the interval
//     the coordinator asks of members (heartbeat_interval_for over all
//     members, as without relays);
//   - the relay answers each beat with the group's assignment and how long
//     ago it last heard the coordinator (a member takes the coordinator as
//     heard then);
//   - the relay beats the coordinator itself, at the interval asked of
//     direct beaters (heartbeat_interval_for over the groups), carrying each
//     member it heard within the heartbeat timeout with that beat's age;
//   - the coordinator takes each as a sign of life at its age, so a member is
//     declared lost heartbeat_timeout after its last beat reached the relay,
//     plus the transit of the relay's beat: the bound is unchanged.
// A member whose relay leaves a beat unanswered for relay_grace beats the
// coordinator directly again, and avoids that relay for two heartbeat
// timeouts; the coordinator names a new relay once the old one is declared
// lost. A relay's loss costs its members nothing: while a relay is silent,
// the coordinator judges its members' silence from the relay's last beat
// (membership_actor's judged_last_seen), and they are back on the
// coordinator within a member interval + relay_grace + a tick of it (683 ms
// of the 1 s timeout at 10,000 nodes and the defaults). A member that died
// with its relay is lost with it, the timeout after the relay's last beat.
//
// Pure pieces, no clocks read: the coordinator's directory of relays, what
// a relay keeps of its members' beats, and a member's choice of where to
// beat.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "actors/liveness.hpp"
#include "actors/node_id.hpp"
#include "job/settings.hpp"
#include "net/wire.hpp"

namespace dtactor {

struct relay_options {
  int32_t group_size = 64;    // cluster.relay_group_size
  int32_t from_nodes = 1000;  // cluster.relay_from_nodes (0: never)
};
inline relay_options relay_options_from(const cluster_settings& c) { return {c.relay_group_size, c.relay_from_nodes}; }

// The coordinator's view: which members can relay, by node rank.
class relay_directory {
 public:
  explicit relay_directory(relay_options o = {}) : o_(o) {}
  // A member at node rank `rank` that listens at `endpoint` (empty: it cannot
  // relay). Replaces what was known of `id`.
  void set(const node_id& id, int32_t rank, const std::string& endpoint);
  void erase(const node_id& id);
  void clear();
  // Relays come on at relay_from_nodes members and go off below three
  // quarters of it (a few losses at the threshold do not send every node
  // back to the coordinator at once). Called at each change of members.
  void update(size_t members);
  bool active() const { return on_; }
  struct relay {
    dtactor::node_id id;
    std::string endpoint;
  };
  // Whether a known relay still is a member at that node rank.
  using still_member = std::function<bool(const dtactor::node_id&, int32_t rank)>;
  // The relay of node rank `rank`'s group; none when relays are not active
  // or no member of the group can relay. Entries that are no longer members
  // at their rank (`valid` false) are dropped on the way.
  std::optional<relay> relay_for(int32_t rank, const still_member& valid);
  // After node ranks moved (an adopted plan): every known relay at its
  // member's new rank (-1: no longer a member).
  void renumber(const std::function<int32_t(const dtactor::node_id&)>& rank_of);
  // Nodes that beat the coordinator itself with `members` members: every one
  // while relays are off, else about one a group.
  size_t direct_beaters(size_t members) const;
  const relay_options& options() const { return o_; }

 private:
  relay_options o_;
  bool on_ = false;
  std::map<int32_t, dtactor::node_id> by_rank_;  // members that can relay
  std::map<dtactor::node_id, std::pair<int32_t, std::string>> known_;  // their ranks and endpoints
};

// The assignment a node gets: its group's relay (the node itself when it is
// the relay), and the interval its group's members beat the relay at (0:
// the configured one). Unset endpoint: beat the coordinator.
pb::relay_assignment to_proto(const std::optional<relay_directory::relay>& r, uint32_t member_interval_ms);

// The largest cluster.relay_group_size (job/settings.cpp bounds it).
inline constexpr size_t max_relay_group_size = 4096;

// What a relay keeps of its members' beats: the newest of each, until it is
// older than the heartbeat timeout. At most `capacity` members (twice the
// largest group, room for ranks that moved): a beat from one more replaces
// the stalest entry.
class relay_hub {
 public:
  explicit relay_hub(size_t capacity = 2 * max_relay_group_size) : capacity_(capacity) {}
  void set_capacity(size_t c) { capacity_ = c; }
  struct beat {
    uint64_t incarnation = 0, generation = 0;
    int64_t step = 0;
    clock_time heard{};
  };
  void heard(const std::string& node_id, const beat& b);
  // Adds every member heard within `timeout` before `now` to `hb` (each with
  // its age) and forgets the older ones.
  void fill(pb::heartbeat& hb, clock_time now, clock_duration timeout);
  // The coordinator refused these relayed members: the next beat of each is
  // answered with that refusal, once (take_refusal), and it is forgotten.
  void refuse(const std::vector<std::string>& ids);
  bool take_refusal(const std::string& node_id);
  size_t size() const { return beats_.size(); }

 private:
  size_t capacity_;
  std::map<std::string, beat> beats_;
  std::set<std::string> refused_;
};

// A member's choice of where to beat, from what the coordinator (or its
// relay) last said.
class relay_link {
 public:
  // Takes an assignment for node `self`. Returns the endpoint to dial when
  // it names a relay other than `self` at an endpoint not dialled now and not
  // avoided; "" when the node should beat the coordinator (also when it is
  // the relay, or the relay is avoided); nullopt when nothing changes.
  std::optional<std::string> assign(const pb::relay_assignment& a, const std::string& self, clock_time now);
  // The endpoint beaten now ("": the coordinator).
  const std::string& endpoint() const { return endpoint_; }
  const std::string& relay_id() const { return relay_id_; }
  // The interval the group's members beat at (0: the configured one).
  std::chrono::milliseconds member_interval() const { return member_interval_; }
  bool is_relay() const { return is_relay_; }
  // The relay answered.
  void acked(clock_time now) {
    acked_ = now;
    unanswered_since_.reset();
  }
  bool answered_since_dial() const { return acked_.has_value(); }
  // A beat went to the relay.
  void beat(clock_time now);
  // The relay has not answered for `grace` since the first beat it left
  // unanswered (`first_grace` before its first answer since it was dialled:
  // the connection's TCP and CURVE handshakes come first): it is given up
  // (avoided for `avoid_for`) and the member beats the coordinator. True
  // once, when that happens.
  bool given_up(clock_time now, clock_duration grace, clock_duration first_grace, clock_duration avoid_for);
  // Back to the coordinator (a registration).
  void reset();

 private:
  std::string endpoint_, relay_id_;
  std::chrono::milliseconds member_interval_{0};
  bool is_relay_ = false;
  std::optional<clock_time> acked_, unanswered_since_;
  std::map<std::string, clock_time> avoided_;  // endpoint -> until
};

// How long a member waits for its relay's answer to a beat: a third of the
// heartbeat timeout (a relay on a loaded machine may answer late; giving it
// up costs its group's direct beats for two timeouts). The coordinator holds
// a member's silence against it only while its relay is heard from
// (membership_actor's judged_last_seen), so a member of a relay that died
// has until the relay's own deadline, and is back within a member interval +
// this + a tick of the relay's last beat.
inline clock_duration relay_grace(const liveness_options& o) { return o.heartbeat_timeout / 3; }
// Before a newly dialled relay's first answer: a quarter of the timeout.
// The member's last beat elsewhere was at most a member interval before it
// dialled, so it is back on the coordinator within 2 member intervals + this
// + a tick (850 ms at 10,000 nodes and the defaults).
inline clock_duration relay_first_grace(const liveness_options& o) { return o.heartbeat_timeout / 4; }

}  // namespace dtactor
