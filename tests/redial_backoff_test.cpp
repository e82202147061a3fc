// A DEALER whose connection is shut before its handshake ends (a
// listener's handshake gate is full) dials again later each time, with
// jitter, instead of libzmq's redial every reconnect interval: the
// backoff's arithmetic, and a bridge shed by a gate that lets nobody in.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <thread>

#include "base/job_key.hpp"
#include "net/redial_backoff.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor {
namespace {

using namespace std::chrono_literals;
using ms = std::chrono::milliseconds;

TEST(RedialBackoff, EachShedDoublesTheDelayUpToTheCapWithinItsUpperHalf) {
  redial_backoff b(ms(100), ms(1000));
  EXPECT_EQ(b.on_disconnected(false, 0.0), ms(50));
  EXPECT_EQ(b.on_disconnected(false, 0.0), ms(100));
  EXPECT_EQ(b.on_disconnected(false, 0.999), ms(399));
  EXPECT_EQ(b.on_disconnected(false, 0.0), ms(400));
  EXPECT_EQ(b.on_disconnected(false, 0.0), ms(500)) << "capped at 1000: half of it at the least";
  EXPECT_EQ(b.on_disconnected(false, 0.5), ms(750));
  EXPECT_EQ(b.sheds(), 6u);
}

TEST(RedialBackoff, AHandshakeThatSucceededStartsOverAndItsCloseIsNoShed) {
  redial_backoff b(ms(100), ms(5000));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(b.on_disconnected(false, 0.0));
  b.on_handshake_succeeded();
  EXPECT_EQ(b.on_disconnected(false, 0.0), std::nullopt) << "a connection that was up closed: libzmq redials at once";
  EXPECT_EQ(b.on_disconnected(false, 0.0), ms(50)) << "the next shed starts over";
}

TEST(RedialBackoff, AReportedFailureIsLeftToLibzmq) {
  redial_backoff b(ms(100), ms(5000));
  EXPECT_EQ(b.on_disconnected(true, 0.0), std::nullopt);
  EXPECT_EQ(b.sheds(), 0u);
}

// A coordinator whose gate sheds every connection (no place in the
// handshake): a node's bridge dials it less and less often, where libzmq
// alone redials every 100-200 ms (a dozen or more a second, as often late
// as early).
TEST(RedialBackoff, ABridgeShedBeforeItsHandshakeDialsLessAndLessOften) {
  auto key = generate_job_key();
  ASSERT_TRUE(key);
  zmq_bridge_options server;
  server.key = std::make_shared<const job_key>(key.value());
  server.max_pending_handshakes = 0;  // every connection is shed as it comes
  zmq_bridge coordinator(server, [](const std::string&, const std::string&, pb::envelope) {});
  auto bound = coordinator.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  auto shed = [&] { return coordinator.stats().handshake_failures[static_cast<std::size_t>(handshake_failure::busy)]; };

  zmq_bridge_options client;
  client.key = server.key;
  client.reconnect_ivl_ms = 100;
  client.reconnect_ivl_max_ms = 0;  // as a node's: libzmq's own redial never backs off
  zmq_bridge node(client, [](const std::string&, const std::string&, pb::envelope) {});
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(node.add_dealer("coordinator", bound.value(), "node-a"));
  std::this_thread::sleep_until(start + 1250ms);
  const auto early = shed();
  std::this_thread::sleep_until(start + 2500ms);
  const auto late = shed() - early;
  const auto took = std::chrono::steady_clock::now() - start;
  const std::string seen = "shed " + std::to_string(early) + " times in the first 1.25 s, " + std::to_string(late) + " in the next (" +
                           std::to_string(std::chrono::duration<double>(took).count()) + " s in all)";
  EXPECT_GE(early, 3u) << "it dials again after each shed; " << seen;
  // Dials at 0 and after 50-100, 100-200, 200-400, 400-800, 800-1600 ms:
  // 4-5 in the first 1.25 s, 1-2 in the next. On a loaded machine
  // libzmq's own redial, 100 ms after a shed, can come before the bridge
  // reads the shed and disconnects (one more shed, which backs off further
  // still). libzmq alone dials 6-12 times in each half.
  EXPECT_LE(late, 4u) << seen;
}

}  // namespace
}  // namespace dtactor
