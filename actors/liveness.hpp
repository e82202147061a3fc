#pragma once
// Failure detection as a pure function of (now, last-seen times, options), in
// the style of torchft's lighthouse: no clocks are read here, so tests move
// timestamps instead of sleeping. ZeroMQ never reports a dead peer; this is
// how dtactor notices one.
#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "actors/node_id.hpp"
#include "job/settings.hpp"

namespace dtactor {

// The clock every actor-side decision uses. It is caf::actor_clock's
// (std::chrono::steady_clock), so CAF's test coordinator can drive it.
using clock_time = std::chrono::steady_clock::time_point;
using clock_duration = std::chrono::steady_clock::duration;

struct liveness_options {
  // Period at which peers send heartbeats (cluster.heartbeat_interval_ms).
  std::chrono::milliseconds heartbeat_interval{100};
  // Silence after which a peer is lost (cluster.heartbeat_timeout_ms). A peer
  // whose last sign of life is exactly `heartbeat_timeout` old is lost.
  std::chrono::milliseconds heartbeat_timeout{1000};
  // While a collective failure is suspected (a rank of the current generation
  // reported STATE_FAILED), silence this long already means lost
  // (cluster.suspect_timeout_ms): a live peer heartbeats every interval, and a
  // dead one has stalled its peers' collectives.
  std::chrono::milliseconds suspect_timeout{300};
  // A peer whose control connection closed (its process ended, so its kernel
  // sent FIN or RST) and that was not heard from since is lost this long
  // after the close: a live peer whose connection merely dropped redials and
  // heartbeats within it (three intervals, at most the heartbeat timeout;
  // set by liveness_options_from). While a collective failure is suspected,
  // a closed connection is a loss at once: two signals agree.
  std::chrono::milliseconds closed_grace{300};
};

// Three heartbeat intervals, at most the heartbeat timeout.
inline std::chrono::milliseconds closed_grace_of(std::chrono::milliseconds interval, std::chrono::milliseconds timeout) {
  return std::min(3 * interval, timeout);
}

// cluster.heartbeat_interval_ms / heartbeat_timeout_ms / suspect_timeout_ms.
inline liveness_options liveness_options_from(const cluster_settings& c) {
  liveness_options o;
  o.heartbeat_interval = c.heartbeat_interval;
  o.heartbeat_timeout = c.heartbeat_timeout;
  o.suspect_timeout = c.suspect_timeout;
  o.closed_grace = closed_grace_of(o.heartbeat_interval, o.heartbeat_timeout);
  return o;
}

// The coordinator's budget of node heartbeats a second. Below it (up to
// about 1,000 nodes at the default 100 ms) nodes heartbeat every
// cluster.heartbeat_interval_ms; past it the coordinator asks them to
// heartbeat less often (heartbeat_interval_for), so that its load grows with
// the heartbeat timeout's floor, not with the configured interval.
inline constexpr int64_t coordinator_heartbeats_per_s = 10000;

// The interval a coordinator with `members` nodes asks them to heartbeat at:
// opts.heartbeat_interval, longer where `members` beating at it would exceed
// coordinator_heartbeats_per_s, and never past a quarter of the heartbeat
// timeout (a live node stays four beats inside it). Detection is unchanged:
// a node is lost heartbeat_timeout after its last sign of life, whatever
// the interval.
std::chrono::milliseconds heartbeat_interval_for(const liveness_options& opts, size_t members);

// The options for judging silence while nodes beat every `interval` (from
// heartbeat_interval_for): the suspect timeout and the closed-connection
// grace stretched to three such intervals (at most the heartbeat timeout);
// unchanged at the configured interval.
liveness_options liveness_at(const liveness_options& opts, std::chrono::milliseconds interval);

// A node asks its coordinator to answer a heartbeat (heartbeat.no_ack
// unset) when it last asked this long ago or more: a quarter of the
// heartbeat timeout, so a live coordinator is heard from four times within
// the timeout the node judges it by.
inline clock_duration ack_every(const liveness_options& opts) { return opts.heartbeat_timeout / 4; }

// The heartbeat settings a node takes from its coordinator's config text
// (register_ack's config_toml, parsed by Config::parse_toml): none when the
// text does not parse or the settings do not make sense together, and the
// node keeps its own. A template so that a test can hand in its own parser.
template <class Config>
std::optional<liveness_options> liveness_options_from_text(const std::string& toml);

// A peer declared lost, keyed as its watcher keys it: a node id (the
// coordinator's members) or a plain name (a node agent's ranks, its
// coordinator).
template <class Key>
struct lost_of {
  Key peer;
  // Time from the peer's last sign of life to this detection: an upper bound
  // of how long the failure went unnoticed (the `detected_after_s` metric).
  double detected_after_s = 0;
  // How far past the deadline (last_seen + timeout) the detection ran; bounded
  // by the tick period of whoever calls find_lost.
  double overdue_s = 0;
  // Lost only because a collective failure was suspected (silent for the
  // suspect timeout, not yet for the heartbeat timeout).
  bool suspected = false;
  // Lost because its connection closed (find_closed), not for silence.
  bool closed = false;
};
using lost_peer = lost_of<std::string>;
using lost_node = lost_of<node_id>;

// Peers silent for at least `heartbeat_timeout` at `now`, ordered by name.
// Never blocks; last-seen times in the future (clock skew between ticks) count
// as "just seen". While `suspecting` a collective failure, the timeout is the
// shorter of heartbeat_timeout and suspect_timeout, and peers lost only
// because of that are marked `suspected`. Key: std::string or node_id.
template <class Key = std::string>
std::vector<lost_of<Key>> find_lost(clock_time now, const std::map<Key, clock_time>& last_seen, const liveness_options& opts, bool suspecting = false);

// Peers whose connection closed at `closed[peer]` and that have not been
// heard from since (the caller keeps only those), lost at `now`: after
// closed_grace, or at once while `suspecting` (then marked `suspected` when
// the grace has not run out). `last_seen` gives detected_after_s (0 for a
// peer it lacks). Ordered by name; never blocks.
template <class Key>
std::vector<lost_of<Key>> find_closed(clock_time now, const std::map<Key, clock_time>& closed, const std::map<Key, clock_time>& last_seen,
                                      const liveness_options& opts, bool suspecting);

// The watcher's own pauses. Silence is evidence only while the watcher was
// there to hear: when its tick comes late (its process descheduled on a
// machine loaded past its cores, swapped out, or stopped), nobody could be
// heard meanwhile, and their heartbeats wait in its queue behind the tick.
// Without this, one stall of the coordinator declares every node lost at
// once. Each tick's lateness beyond half an interval is a pause, credited to
// every peer (credit_pause): a peer is lost after heartbeat_timeout of
// silence the watcher was awake for. A watcher slowed for good (ticks
// always late) still detects, later in proportion: the bound is the
// timeout of awake time.
class pause_tracker {
 public:
  // Called at every tick of period `interval`; the pause since the previous
  // tick (zero on the first, and when on time).
  clock_duration on_tick(clock_time now, clock_duration interval);
  // Pauses credited so far, and the longest.
  clock_duration total() const { return total_; }
  clock_duration longest() const { return longest_; }

 private:
  std::optional<clock_time> last_;
  clock_duration total_{0}, longest_{0};
};

// Moves a last-seen time forward by `pause`, never past `now`.
inline clock_time credit_pause(clock_time last_seen, clock_duration pause, clock_time now) {
  return last_seen >= now ? last_seen : std::min(now, last_seen + pause);
}

// When `peer` (last seen at `last_seen`) will be declared lost.
inline clock_time lost_deadline(clock_time last_seen, const liveness_options& opts) { return last_seen + opts.heartbeat_timeout; }

// Empty when the options make sense, else one line saying what to change.
std::string validate(const liveness_options& opts);

template <class Config>
std::optional<liveness_options> liveness_options_from_text(const std::string& toml) {
  auto c = Config::parse_toml(toml, "register_ack");
  if (!c) return std::nullopt;
  auto cluster = cluster_settings_of(c.value());
  if (!cluster) return std::nullopt;
  auto l = liveness_options_from(cluster.value());
  if (!validate(l).empty()) return std::nullopt;
  return l;
}

}  // namespace dtactor
