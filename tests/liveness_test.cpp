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

TEST(liveness, options_from_config_keys) {
  struct fake_config {
    int64_t get_int(const std::string& k) const {
      static const std::map<std::string, int64_t> keys{
          {"cluster.heartbeat_interval_ms", 50}, {"cluster.heartbeat_timeout_ms", 700}, {"cluster.suspect_timeout_ms", 250}};
      return keys.at(k);
    }
  };
  auto o = liveness_options_from(fake_config{});
  EXPECT_EQ(o.heartbeat_interval, 50ms);
  EXPECT_EQ(o.heartbeat_timeout, 700ms);
  EXPECT_EQ(o.suspect_timeout, 250ms);
}
