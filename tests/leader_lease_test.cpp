// The job's leader lease in a directory (storage/leader_lease.hpp): one
// holder at a time, a standby takes over only after the holder's renewals
// stopped for the TTL (on a fake clock here) or it released the lease, and
// the old holder is then deposed at its next renewal.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>
#include <vector>

#include "storage/leader_lease.hpp"
#include "test_util.hpp"

using namespace dtactor;
using namespace std::chrono_literals;
using dtactor::testing::temp_dir;

namespace {

struct fake_clock {
  std::chrono::steady_clock::time_point t{std::chrono::hours(1)};
};

std::unique_ptr<leader_lease> open_in(const std::string& dir, fake_clock& c) {
  lease_options o;
  o.ttl = 3000ms;
  o.now = [&c] { return c.t; };
  auto l = open_leader_lease(dir, o);
  EXPECT_TRUE(l) << l.message();
  return std::move(l.value());
}

lease_holder named(const std::string& id) { return {0, id, "tcp://" + id + ":29500"}; }

}  // namespace

TEST(LeaderLease, TheFirstTakesEpochOneAndAStandbyWaitsWhileItRenews) {
  temp_dir d;
  fake_clock clock;
  auto a = open_in(d.path(), clock), b = open_in(d.path(), clock);
  auto first = a->try_acquire(named("a"));
  ASSERT_TRUE(first) << first.message();
  ASSERT_TRUE(first->taken);
  EXPECT_EQ(first->current.epoch, 1u);
  for (int i = 0; i < 5; ++i) {
    auto claim = b->try_acquire(named("b"));
    ASSERT_TRUE(claim) << claim.message();
    EXPECT_FALSE(claim->taken) << "a renews: b must wait";
    EXPECT_EQ(claim->current.holder, "a");
    EXPECT_EQ(claim->current.address, "tcp://a:29500");
    clock.t += 2000ms;  // under the TTL since the last change
    ASSERT_EQ(a->renew().value(), renewal::renewed);
  }
  EXPECT_EQ(b->current()->holder, "a");
}

TEST(LeaderLease, AStandbyTakesALapsedLeaseAndTheOldHolderIsDeposed) {
  temp_dir d;
  fake_clock clock;
  auto a = open_in(d.path(), clock), b = open_in(d.path(), clock);
  ASSERT_TRUE(a->try_acquire(named("a"))->taken);
  EXPECT_FALSE(b->try_acquire(named("b"))->taken);  // b starts watching a's heartbeat
  clock.t += 2999ms;
  EXPECT_FALSE(b->try_acquire(named("b"))->taken) << "silent for less than the TTL";
  clock.t += 1ms;
  auto claim = b->try_acquire(named("b"));
  ASSERT_TRUE(claim) << claim.message();
  ASSERT_TRUE(claim->taken) << "silent for the TTL";
  EXPECT_EQ(claim->current.epoch, 2u);
  EXPECT_EQ(a->renew().value(), renewal::deposed) << "a partitioned old holder learns it at its next renewal";
  EXPECT_EQ(b->renew().value(), renewal::renewed);
  auto now = a->current();
  EXPECT_EQ(now->epoch, 2u);
  EXPECT_EQ(now->holder, "b");
}

// A holder that was itself silent for the TTL (stopped, or a renewal that
// came too late) takes the lease back at the next epoch when no standby
// took it, and a standby watching then waits on; when a standby took it,
// or took and passed on several epochs (whose old files are gone), the
// holder is deposed.
TEST(LeaderLease, AHolderSilentForTheTTLTakesItBackAtTheNextEpochUnlessAnotherTookIt) {
  temp_dir d;
  fake_clock clock;
  auto a = open_in(d.path(), clock), b = open_in(d.path(), clock);
  ASSERT_TRUE(a->try_acquire(named("a"))->taken);
  EXPECT_FALSE(b->try_acquire(named("b"))->taken);  // b starts watching
  clock.t += 5000ms;                                 // a silent past the TTL
  auto back = a->reclaim();
  ASSERT_TRUE(back) << back.message();
  ASSERT_TRUE(back->has_value()) << "nobody else took it";
  EXPECT_EQ(**back, 2u);
  EXPECT_EQ(a->renew().value(), renewal::renewed);
  auto claim = b->try_acquire(named("b"));
  EXPECT_FALSE(claim->taken) << "a holds epoch 2 now, freshly";
  EXPECT_EQ(claim->current.holder, "a");
  EXPECT_EQ(claim->current.epoch, 2u);
  // b takes over while a is silent again: a's reclaim finds epoch 3.
  clock.t += 3000ms;
  ASSERT_TRUE(b->try_acquire(named("b"))->taken);
  auto lost = a->reclaim();
  ASSERT_TRUE(lost) << lost.message();
  EXPECT_FALSE(lost->has_value()) << "b holds epoch 3";
  EXPECT_EQ(a->current()->holder, "b");
}

TEST(LeaderLease, AHolderSilentWhileOthersHeldSeveralEpochsIsDeposed) {
  temp_dir d;
  fake_clock clock;
  auto a = open_in(d.path(), clock), b = open_in(d.path(), clock);
  ASSERT_TRUE(a->try_acquire(named("a"))->taken);
  for (int i = 0; i < 3; ++i) {  // b takes epochs 2, 3, 4, releasing each; epoch 2's file goes
    auto c = b->try_acquire(named("b"));
    if (!c->taken) {
      clock.t += 3000ms;
      c = b->try_acquire(named("b"));
    }
    ASSERT_TRUE(c->taken);
    ASSERT_TRUE(b->release());
  }
  EXPECT_FALSE(std::filesystem::exists(d.path() + "/epoch-2"));
  auto lost = a->reclaim();
  ASSERT_TRUE(lost) << lost.message();
  EXPECT_FALSE(lost->has_value()) << "epoch 2 is free again but others held newer ones";
}

TEST(LeaderLease, AReleasedLeaseIsTakenAtOnce) {
  temp_dir d;
  fake_clock clock;
  auto a = open_in(d.path(), clock), b = open_in(d.path(), clock);
  ASSERT_TRUE(a->try_acquire(named("a"))->taken);
  ASSERT_TRUE(a->release());
  auto claim = b->try_acquire(named("b"));
  ASSERT_TRUE(claim->taken);
  EXPECT_EQ(claim->current.epoch, 2u);
}

// Standbys racing for a lapsed lease: exactly one wins each epoch.
TEST(LeaderLease, OfStandbysRacingForALapsedLeaseExactlyOneWins) {
  temp_dir d;
  fake_clock clock;
  auto holder = open_in(d.path(), clock);
  ASSERT_TRUE(holder->try_acquire(named("h"))->taken);
  std::vector<std::unique_ptr<leader_lease>> standbys;
  for (int i = 0; i < 8; ++i) {
    standbys.push_back(open_in(d.path(), clock));
    EXPECT_FALSE(standbys.back()->try_acquire(named("s" + std::to_string(i)))->taken);
  }
  clock.t += 3000ms;
  std::vector<int> won(standbys.size(), 0);
  std::vector<std::thread> ts;
  for (size_t i = 0; i < standbys.size(); ++i)
    ts.emplace_back([&, i] {
      auto c = standbys[i]->try_acquire(named("s" + std::to_string(i)));
      won[i] = c && c->taken ? 1 : 0;
    });
  for (auto& t : ts) t.join();
  int winners = 0;
  for (int w : won) winners += w;
  EXPECT_EQ(winners, 1);
  EXPECT_EQ(holder->current()->epoch, 2u);
}

TEST(LeaderLease, PlacesItCannotUseAreOneLine) {
  auto other = open_leader_lease("zk://host:2181");
  ASSERT_FALSE(other);
  EXPECT_NE(other.message().find("neither etcd://"), std::string::npos) << other.message();
  auto no_host = open_leader_lease("etcd:///prefix");
  EXPECT_FALSE(no_host);
  // Judged from the text alone, before anything is made (a coordinator
  // refuses a bad --lease before it creates its run directory).
  EXPECT_NE(lease_place_problem("s3://"), "");
  EXPECT_NE(lease_place_problem("s3:///job"), "");
  EXPECT_EQ(lease_place_problem("s3://bucket/job"), "");  // its server's conditional writes are probed when opened (s3_lease.*)
  EXPECT_NE(lease_place_problem("etcd://"), "");
  EXPECT_NE(lease_place_problem(""), "");
  EXPECT_EQ(lease_place_problem("etcd://10.0.0.5:2379/jobs/vit"), "");
  EXPECT_EQ(lease_place_problem("/shared/leases/vit"), "");
  EXPECT_FALSE(std::filesystem::exists("/shared/leases/vit"));
  lease_options fast;
  fast.ttl = 10ms;
  EXPECT_FALSE(open_leader_lease("/tmp", fast));
  temp_dir d;
  const std::string file = d.path() + "/a-file";
  { std::ofstream(file) << "x"; }
  auto not_dir = open_leader_lease(file);
  ASSERT_FALSE(not_dir);
  EXPECT_NE(not_dir.message().find("not a directory"), std::string::npos) << not_dir.message();
}
