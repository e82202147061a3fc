#include "actors/liveness.hpp"

#include <algorithm>

namespace dtactor {

namespace {
double seconds(clock_duration d) { return std::chrono::duration<double>(d).count(); }
}  // namespace

template <class Key>
std::vector<lost_of<Key>> find_lost(clock_time now, const std::map<Key, clock_time>& last_seen, const liveness_options& opts, bool suspecting) {
  const clock_duration timeout =
      suspecting ? std::min<clock_duration>(opts.heartbeat_timeout, opts.suspect_timeout) : clock_duration{opts.heartbeat_timeout};
  std::vector<lost_of<Key>> lost;
  for (const auto& [peer, seen] : last_seen) {
    if (seen > now) continue;
    auto silent = now - seen;
    if (silent < timeout) continue;
    lost.push_back(lost_of<Key>{peer, seconds(silent), seconds(silent - timeout), silent < opts.heartbeat_timeout});
  }
  return lost;
}

template <class Key>
std::vector<lost_of<Key>> find_closed(clock_time now, const std::map<Key, clock_time>& closed, const std::map<Key, clock_time>& last_seen,
                                      const liveness_options& opts, bool suspecting) {
  std::vector<lost_of<Key>> lost;
  for (const auto& [peer, at] : closed) {
    const clock_duration since = now > at ? now - at : clock_duration{0};
    const bool graced = since >= opts.closed_grace;
    if (!graced && !suspecting) continue;
    const auto seen = last_seen.find(peer);
    const double silent = seen == last_seen.end() || seen->second > now ? 0 : seconds(now - seen->second);
    lost_of<Key> l{peer, silent, graced ? seconds(since - opts.closed_grace) : 0, !graced};
    l.closed = true;
    lost.push_back(std::move(l));
  }
  return lost;
}

// The watchers' keys: a node agent's plain names, the coordinator's node ids.
template std::vector<lost_peer> find_lost(clock_time, const std::map<std::string, clock_time>&, const liveness_options&, bool);
template std::vector<lost_node> find_lost(clock_time, const std::map<node_id, clock_time>&, const liveness_options&, bool);
template std::vector<lost_peer> find_closed(clock_time, const std::map<std::string, clock_time>&, const std::map<std::string, clock_time>&,
                                            const liveness_options&, bool);
template std::vector<lost_node> find_closed(clock_time, const std::map<node_id, clock_time>&, const std::map<node_id, clock_time>&,
                                            const liveness_options&, bool);

clock_duration pause_tracker::on_tick(clock_time now, clock_duration interval) {
  const auto previous = last_;
  last_ = now;
  if (!previous || now <= *previous) return clock_duration{0};
  const auto late = (now - *previous) - interval;
  if (late <= interval / 2) return clock_duration{0};
  total_ += late;
  longest_ = std::max(longest_, late);
  return late;
}

std::chrono::milliseconds heartbeat_interval_for(const liveness_options& opts, size_t members) {
  using std::chrono::milliseconds;
  const int64_t spread_ms = static_cast<int64_t>(members) * 1000 / coordinator_heartbeats_per_s;
  const milliseconds ceiling = std::max(opts.heartbeat_interval, opts.heartbeat_timeout / 4);
  return std::clamp(milliseconds(spread_ms), opts.heartbeat_interval, ceiling);
}

liveness_options liveness_at(const liveness_options& opts, std::chrono::milliseconds interval) {
  if (interval <= opts.heartbeat_interval) return opts;
  liveness_options o = opts;
  const auto stretched = closed_grace_of(interval, opts.heartbeat_timeout);
  o.suspect_timeout = std::max(opts.suspect_timeout, stretched);
  o.closed_grace = std::max(opts.closed_grace, stretched);
  return o;
}

std::string validate(const liveness_options& opts) {
  if (opts.heartbeat_interval.count() <= 0) return "cluster.heartbeat_interval_ms must be positive";
  if (opts.heartbeat_timeout <= opts.heartbeat_interval)
    return "cluster.heartbeat_timeout_ms (" + std::to_string(opts.heartbeat_timeout.count()) +
           ") must be larger than cluster.heartbeat_interval_ms (" + std::to_string(opts.heartbeat_interval.count()) + "); a few intervals is usual";
  if (opts.suspect_timeout <= opts.heartbeat_interval)
    return "cluster.suspect_timeout_ms (" + std::to_string(opts.suspect_timeout.count()) + ") must be larger than cluster.heartbeat_interval_ms (" +
           std::to_string(opts.heartbeat_interval.count()) + "), or live nodes are declared lost after a collective failure";
  return {};
}

}  // namespace dtactor
