#include "actors/liveness.hpp"

#include <gtest/gtest.h>

using namespace dtactor;
using namespace std::chrono_literals;

namespace {
clock_time t0() { return clock_time{} + 1h; }
liveness_options opts() { return liveness_options{100ms, 1000ms}; }
}  // namespace

TEST(liveness, peers_within_timeout_are_alive) {
  std::map<std::string, clock_time> seen{{"a", t0()}, {"b", t0() + 500ms}};
  EXPECT_TRUE(find_lost(t0() + 999ms, seen, opts()).empty());
}

TEST(liveness, a_peer_silent_for_exactly_the_timeout_is_lost) {
  std::map<std::string, clock_time> seen{{"a", t0()}, {"b", t0() + 500ms}};
  auto lost = find_lost(t0() + 1000ms, seen, opts());
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].peer, "a");
  EXPECT_DOUBLE_EQ(lost[0].detected_after_s, 1.0);
  EXPECT_DOUBLE_EQ(lost[0].overdue_s, 0.0);
}

TEST(liveness, reports_how_long_each_lost_peer_was_silent_in_name_order) {
  std::map<std::string, clock_time> seen{{"b", t0()}, {"a", t0() + 200ms}, {"c", t0() + 1400ms}};
  auto lost = find_lost(t0() + 1500ms, seen, opts());
  ASSERT_EQ(lost.size(), 2u);
  EXPECT_EQ(lost[0].peer, "a");
  EXPECT_NEAR(lost[0].detected_after_s, 1.3, 1e-9);
  EXPECT_NEAR(lost[0].overdue_s, 0.3, 1e-9);
  EXPECT_EQ(lost[1].peer, "b");
  EXPECT_NEAR(lost[1].detected_after_s, 1.5, 1e-9);
}

TEST(liveness, last_seen_in_the_future_counts_as_just_seen) {
  std::map<std::string, clock_time> seen{{"a", t0() + 5s}};
  EXPECT_TRUE(find_lost(t0(), seen, opts()).empty());
}

TEST(liveness, deadline_and_validation) {
  EXPECT_EQ(lost_deadline(t0(), opts()), t0() + 1s);
  EXPECT_EQ(validate(opts()), "");
  EXPECT_NE(validate(liveness_options{100ms, 100ms}).find("cluster.heartbeat_timeout_ms"), std::string::npos);
  EXPECT_NE(validate(liveness_options{0ms, 100ms}), "");
}

TEST(liveness, suspecting_uses_the_shorter_suspect_timeout_and_marks_who_it_caught) {
  liveness_options o{100ms, 1000ms, 300ms};
  std::map<std::string, clock_time> seen{{"a", t0()}, {"b", t0() + 800ms}, {"c", t0() + 1000ms}};
  auto now = t0() + 1200ms;
  auto plain = find_lost(now, seen, o);
  ASSERT_EQ(plain.size(), 1u);
  EXPECT_EQ(plain[0].peer, "a");
  EXPECT_FALSE(plain[0].suspected);
  EXPECT_EQ(find_lost(now, seen, o, false).size(), 1u);
  auto suspect = find_lost(now, seen, o, true);
  ASSERT_EQ(suspect.size(), 2u);
  EXPECT_EQ(suspect[0].peer, "a");
  EXPECT_FALSE(suspect[0].suspected);  // silent past the heartbeat timeout anyway
  EXPECT_EQ(suspect[1].peer, "b");
  EXPECT_TRUE(suspect[1].suspected);
  EXPECT_NEAR(suspect[1].detected_after_s, 0.4, 1e-9);
  EXPECT_NEAR(suspect[1].overdue_s, 0.1, 1e-9);
  // c heartbeated 200 ms ago: alive even while suspecting.
}

TEST(liveness, a_suspect_timeout_above_the_heartbeat_timeout_changes_nothing) {
  liveness_options o{100ms, 1000ms, 5000ms};
  std::map<std::string, clock_time> seen{{"a", t0()}};
  EXPECT_TRUE(find_lost(t0() + 999ms, seen, o, true).empty());
  auto lost = find_lost(t0() + 1000ms, seen, o, true);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_FALSE(lost[0].suspected);
}

TEST(liveness, suspect_timeout_must_exceed_the_heartbeat_interval) {
  EXPECT_NE(validate(liveness_options{100ms, 1000ms, 100ms}).find("cluster.suspect_timeout_ms"), std::string::npos);
  EXPECT_EQ(validate(liveness_options{100ms, 1000ms, 300ms}), "");
}

// Past the coordinator's heartbeat budget, nodes are asked to beat less
// often, never past a quarter of the timeout; below it, as configured.
TEST(liveness, the_interval_asked_of_nodes_grows_past_the_budget_up_to_a_quarter_of_the_timeout) {
  EXPECT_EQ(heartbeat_interval_for(opts(), 0), 100ms);
  EXPECT_EQ(heartbeat_interval_for(opts(), 1000), 100ms);                  // 10,000 beats a second: the budget
  EXPECT_EQ(heartbeat_interval_for(opts(), 2000), 200ms);                  // spread to stay at the budget
  EXPECT_EQ(heartbeat_interval_for(opts(), 3000), 250ms);                  // a quarter of the 1 s timeout
  EXPECT_EQ(heartbeat_interval_for(opts(), 10000), 250ms);
  EXPECT_EQ(heartbeat_interval_for(liveness_options{100ms, 4000ms}, 3000), 300ms);
  EXPECT_EQ(heartbeat_interval_for(liveness_options{500ms, 1000ms}, 10000), 500ms);  // never below the configured interval
}

// Judging silence at a stretched interval: a live node beats every 250 ms,
// so a suspect window of 300 ms would catch live nodes; it stretches to
// three intervals (at most the timeout). The timeout itself never moves.
TEST(liveness, a_stretched_interval_stretches_the_suspect_window_and_the_closed_grace_not_the_timeout) {
  auto o = opts();
  o.suspect_timeout = 300ms;
  o.closed_grace = 300ms;
  const auto same = liveness_at(o, 100ms);
  EXPECT_EQ(same.suspect_timeout, 300ms);
  EXPECT_EQ(same.closed_grace, 300ms);
  const auto wide = liveness_at(o, 250ms);
  EXPECT_EQ(wide.suspect_timeout, 750ms);
  EXPECT_EQ(wide.closed_grace, 750ms);
  EXPECT_EQ(wide.heartbeat_timeout, 1000ms);
  EXPECT_EQ(wide.heartbeat_interval, 100ms);  // the watcher's tick stays
  // A live node 600 ms silent while suspecting: lost at the configured
  // window, alive at the stretched one.
  const std::map<std::string, clock_time> seen{{"a", t0() - 600ms}};
  EXPECT_EQ(find_lost(t0(), seen, o, true).size(), 1u);
  EXPECT_TRUE(find_lost(t0(), seen, wide, true).empty());
}

TEST(liveness, options_from_config_keys) {
  config cfg;
  for (const char* kv : {"cluster.heartbeat_interval_ms=50", "cluster.heartbeat_timeout_ms=700", "cluster.suspect_timeout_ms=250"}) {
    const std::string s(kv);
    ASSERT_TRUE(cfg.set(s.substr(0, s.find('=')), s.substr(s.find('=') + 1))) << s;
  }
  auto cluster = cluster_settings_of(cfg);
  ASSERT_TRUE(cluster) << cluster.message();
  auto o = liveness_options_from(cluster.value());
  EXPECT_EQ(o.heartbeat_interval, 50ms);
  EXPECT_EQ(o.heartbeat_timeout, 700ms);
  EXPECT_EQ(o.suspect_timeout, 250ms);
}

TEST(liveness, a_late_tick_is_a_pause_of_the_watcher_and_on_time_ones_are_not) {
  pause_tracker p;
  EXPECT_EQ(p.on_tick(t0(), 100ms), 0ms) << "the first tick has nothing to compare with";
  EXPECT_EQ(p.on_tick(t0() + 100ms, 100ms), 0ms);
  EXPECT_EQ(p.on_tick(t0() + 240ms, 100ms), 0ms) << "40 ms late is scheduling, not a pause";
  EXPECT_EQ(p.on_tick(t0() + 1640ms, 100ms), 1300ms) << "1.4 s between ticks of 100 ms";
  EXPECT_EQ(p.on_tick(t0() + 1740ms, 100ms), 0ms);
  EXPECT_EQ(p.total(), 1300ms);
  EXPECT_EQ(p.longest(), 1300ms);
}

// The coordinator stalled 1.4 s (a machine loaded past its cores): every
// node's heartbeats waited in its queue. Crediting the pause keeps them
// members; a node that really went silent is still lost once the watcher
// has been awake for the timeout.
TEST(liveness, a_watchers_pause_does_not_declare_every_peer_lost_but_real_silence_still_is) {
  pause_tracker p;
  std::map<std::string, clock_time> seen{{"a", t0() + 100ms}, {"b", t0() + 100ms}, {"dead", t0() - 900ms}};
  p.on_tick(t0() + 100ms, 100ms);
  const clock_time now = t0() + 1500ms;  // the next tick, 1.4 s later
  const auto pause = p.on_tick(now, 100ms);
  ASSERT_EQ(pause, 1300ms);
  EXPECT_EQ(find_lost(now, seen, opts()).size(), 3u) << "without the credit, everyone is lost";
  for (auto& [peer, t] : seen) t = credit_pause(t, pause, now);
  auto lost = find_lost(now, seen, opts());
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].peer, "dead") << "silent 1 s before the pause: 1.1 s of awake silence";
  // a and b's heartbeats queued behind the tick arrive; they stay.
  seen["a"] = seen["b"] = now + 1ms;
  EXPECT_TRUE(find_lost(now + 900ms, {{"a", seen["a"]}, {"b", seen["b"]}}, opts()).empty());
  // A last-seen time is never moved past now.
  EXPECT_EQ(credit_pause(t0(), 10s, t0() + 1s), t0() + 1s);
}

// A closed connection: the peer's process ended (its kernel sent FIN or
// RST). Alone it is a loss after the grace, in which a live peer whose
// connection merely dropped redials and heartbeats (the caller then no
// longer passes it); with a suspected collective failure, at once.
TEST(liveness, a_closed_connection_is_lost_after_the_grace_or_at_once_while_suspecting) {
  liveness_options o{100ms, 1000ms, 300ms};
  o.closed_grace = 300ms;
  std::map<std::string, clock_time> seen{{"a", t0() - 50ms}, {"b", t0()}};
  std::map<std::string, clock_time> closed{{"a", t0()}};
  EXPECT_TRUE(find_closed(t0() + 299ms, closed, seen, o, false).empty());
  auto graced = find_closed(t0() + 310ms, closed, seen, o, false);
  ASSERT_EQ(graced.size(), 1u);
  EXPECT_EQ(graced[0].peer, "a");
  EXPECT_TRUE(graced[0].closed);
  EXPECT_FALSE(graced[0].suspected);
  EXPECT_NEAR(graced[0].detected_after_s, 0.36, 1e-9);
  EXPECT_NEAR(graced[0].overdue_s, 0.01, 1e-9);
  auto at_once = find_closed(t0() + 2ms, closed, seen, o, true);
  ASSERT_EQ(at_once.size(), 1u);
  EXPECT_EQ(at_once[0].peer, "a");
  EXPECT_TRUE(at_once[0].closed);
  EXPECT_TRUE(at_once[0].suspected);
  EXPECT_NEAR(at_once[0].detected_after_s, 0.052, 1e-9);
  // Silence alone is not this function's business: b is silent, not closed.
  EXPECT_TRUE(find_closed(t0() + 5s, {}, seen, o, true).empty());
  // A close stamped after `now` (clock skew between threads) waits its grace.
  EXPECT_TRUE(find_closed(t0(), {{"a", t0() + 1ms}}, seen, o, false).empty());
}

TEST(liveness, the_closed_grace_is_three_intervals_at_most_the_timeout) {
  EXPECT_EQ(closed_grace_of(100ms, 1000ms), 300ms);
  EXPECT_EQ(closed_grace_of(100ms, 250ms), 250ms);
  config cfg;
  ASSERT_TRUE(cfg.set("cluster.heartbeat_interval_ms", "50"));
  auto cluster = cluster_settings_of(cfg);
  ASSERT_TRUE(cluster) << cluster.message();
  EXPECT_EQ(liveness_options_from(cluster.value()).closed_grace, 150ms);
}
