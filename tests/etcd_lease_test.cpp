// The job's leader lease in a real etcd (Debian's etcd-server, started here
// on free local ports): one holder at a time, a standby takes over once
// etcd expired the holder's lease, with a newer epoch (the leader key's
// create revision), and the old holder is then deposed at its renewal.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "base/process.hpp"
#include "storage/leader_lease.hpp"
#include "test_util.hpp"

using namespace dtactor;
using namespace std::chrono_literals;
using dtactor::testing::temp_dir;

namespace {

int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(s);
  return ntohs(a.sin_port);
}

// etcd in `dir`, serving clients on 127.0.0.1:port.
struct etcd_server {
  temp_dir dir;
  int port = free_port();
  child_process proc;
  std::string error;
  etcd_server() {
    if (::access("/usr/bin/etcd", X_OK) != 0) {
      error = "etcd is not installed (Debian's etcd-server; scripts/install-deps.sh --test)";
      return;
    }
    const std::string client = "http://127.0.0.1:" + std::to_string(port);
    const std::string peer = "http://127.0.0.1:" + std::to_string(free_port());
    auto p = child_process::spawn({"/usr/bin/etcd", "--data-dir", dir.path() + "/data", "--listen-client-urls", client, "--advertise-client-urls", client,
                                   "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", "default=" + peer},
                                  true, dir.path() + "/etcd.log");
    if (!p) {
      error = p.message();
      return;
    }
    proc = std::move(p.value());
    // Ready when the lease answers who holds it.
    auto l = open_leader_lease(where());
    for (int i = 0; i < 300; ++i) {
      if (l && l.value()->current()) return;
      std::this_thread::sleep_for(50ms);  // polling a process we started; it has no event to wait on
    }
    error = "etcd did not start within 15 s";
  }
  std::string where() const { return "etcd://127.0.0.1:" + std::to_string(port) + "/dtactor-test"; }
};

std::unique_ptr<leader_lease> open_at(const etcd_server& e) {
  lease_options o;
  o.ttl = 2000ms;
  auto l = open_leader_lease(e.where(), o);
  EXPECT_TRUE(l) << l.message();
  return std::move(l.value());
}

lease_holder named(const std::string& id) { return {0, id, "tcp://" + id + ":29500"}; }

}  // namespace

TEST(EtcdLease, OneHolderAtATimeAndAStandbyTakesOverWithANewerEpochWhenItsLeaseExpires) {
  etcd_server etcd;
  if (!etcd.error.empty()) SKIP_OR_FAIL_IN_CI(etcd.error);
  auto a = open_at(etcd), b = open_at(etcd);
  auto first = a->try_acquire(named("a"));
  ASSERT_TRUE(first) << first.message();
  ASSERT_TRUE(first->taken);
  const uint64_t epoch_a = first->current.epoch;
  EXPECT_GT(epoch_a, 0u);
  // While a renews, b cannot take it, and sees a.
  for (int i = 0; i < 3; ++i) {
    auto claim = b->try_acquire(named("b"));
    ASSERT_TRUE(claim) << claim.message();
    EXPECT_FALSE(claim->taken);
    EXPECT_EQ(claim->current.holder, "a");
    EXPECT_EQ(claim->current.epoch, epoch_a);
    ASSERT_EQ(a->renew().value(), renewal::renewed);
  }
  // a stops renewing (a lost machine): etcd expires its lease; b takes it.
  std::optional<lease_claim> taken;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  while (!taken && std::chrono::steady_clock::now() < deadline) {
    auto claim = b->try_acquire(named("b"));
    ASSERT_TRUE(claim) << claim.message();
    if (claim->taken) taken = *claim;
    else std::this_thread::sleep_for(200ms);  // a standby's polling period
  }
  ASSERT_TRUE(taken) << "etcd never expired a's lease";
  EXPECT_GT(taken->current.epoch, epoch_a);
  auto lost = a->reclaim();  // a, late by its own clock, tries to take it back
  ASSERT_TRUE(lost) << lost.message();
  EXPECT_FALSE(lost->has_value()) << "b holds the key now";
  EXPECT_FALSE(a->renew()) << "a holds nothing now";
  EXPECT_EQ(b->renew().value(), renewal::renewed);
  EXPECT_EQ(a->current()->holder, "b");
}

// The server expires an etcd lease, not the holder's clock: a holder late
// to renew by its own clock takes the lease back at the same epoch while
// etcd kept it (deposed once another took the key: the test above).
TEST(EtcdLease, AHolderLateByItsOwnClockKeepsTheEpochWhileEtcdKeptTheLease) {
  etcd_server etcd;
  if (!etcd.error.empty()) SKIP_OR_FAIL_IN_CI(etcd.error);
  auto a = open_at(etcd), b = open_at(etcd);
  auto first = a->try_acquire(named("a"));
  ASSERT_TRUE(first && first->taken);
  auto back = a->reclaim();
  ASSERT_TRUE(back) << back.message();
  ASSERT_TRUE(back->has_value());
  EXPECT_EQ(**back, first->current.epoch);
  EXPECT_FALSE(b->try_acquire(named("b"))->taken);
}

TEST(EtcdLease, AReleasedLeaseIsTakenAtOnce) {
  etcd_server etcd;
  if (!etcd.error.empty()) SKIP_OR_FAIL_IN_CI(etcd.error);
  auto a = open_at(etcd), b = open_at(etcd);
  ASSERT_TRUE(a->try_acquire(named("a"))->taken);
  ASSERT_TRUE(a->release());
  auto claim = b->try_acquire(named("b"));
  ASSERT_TRUE(claim) << claim.message();
  EXPECT_TRUE(claim->taken);
}

TEST(EtcdLease, AnEtcdThatIsNotThereIsOneLine) {
  lease_options o;
  o.request_timeout = 500ms;
  auto l = open_leader_lease("etcd://127.0.0.1:" + std::to_string(free_port()), o);
  ASSERT_TRUE(l);
  auto claim = l.value()->try_acquire(named("a"));
  ASSERT_FALSE(claim);
  EXPECT_NE(claim.message().find("leader lease: etcd at http://127.0.0.1:"), std::string::npos) << claim.message();
  EXPECT_EQ(claim.message().find('\n'), std::string::npos);
}
