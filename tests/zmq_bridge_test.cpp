#include "net/zmq_bridge.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <optional>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <zmq.hpp>

#include "tests/test_util.hpp"

namespace dtactor {
namespace {

using namespace std::chrono_literals;

// Safety net for every wait; the tests wait on events, never on time.
constexpr auto patience = 10s;

struct received {
  std::string link;
  std::string peer;
  pb::envelope env;
};

// Collects what a bridge's handlers deliver, for the test thread to wait on.
class inbox {
 public:
  zmq_bridge::inbound_handler handler() {
    return [this](const std::string& link, const std::string& peer, pb::envelope env) {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(received{link, peer, std::move(env)});
      cv_.notify_all();
    };
  }
  zmq_bridge::drop_handler drop_handler() {
    return [this](const std::string&, const std::string&, wire::drop_kind kind) {
      std::lock_guard<std::mutex> lock(mu_);
      drops_.push_back(kind);
      cv_.notify_all();
    };
  }
  // Records a closed connection in the same queue as the envelopes (an
  // empty envelope whose link is "closed"), so that tests see the order.
  zmq_bridge::closed_handler closed_handler() {
    return [this](const std::string&, const std::string& peer) {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(received{"closed", peer, {}});
      cv_.notify_all();
    };
  }
  // Records a DEALER connection that came up the same way (link
  // "connected", the endpoint as its peer).
  zmq_bridge::connected_handler connected_handler() {
    return [this](const std::string&, const std::string& endpoint) {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(received{"connected", endpoint, {}});
      cv_.notify_all();
    };
  }
  // The next envelope, or nullopt after `patience`.
  std::optional<received> next(std::chrono::milliseconds timeout = patience) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return !items_.empty(); })) return std::nullopt;
    auto r = std::move(items_.front());
    items_.pop_front();
    return r;
  }
  // Waits until `n` drops of `kind` were reported.
  bool wait_drops(wire::drop_kind kind, std::size_t n) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, patience, [&] {
      return static_cast<std::size_t>(std::count(drops_.begin(), drops_.end(), kind)) >= n;
    });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<received> items_;
  std::vector<wire::drop_kind> drops_;
};

pb::envelope heartbeat(const std::string& sender, uint64_t seq, const std::string& job = "job-1") {
  auto env = make_envelope(envelope_header{wire::protocol_version, job, sender, 11}, 3);
  env.mutable_heartbeat()->set_seq(seq);
  return env;
}

std::string bytes_of(const pb::envelope& env) { return env.SerializeAsString(); }

zmq_bridge_options test_options() {
  zmq_bridge_options o;
  o.job_id = "job-1";
  o.reconnect_ivl_ms = 20;
  o.reconnect_ivl_max_ms = 200;
  return o;
}

std::string tcp_endpoint() {
  auto port = pick_free_tcp_port();
  EXPECT_TRUE(port) << port.message();
  return "tcp://127.0.0.1:" + std::to_string(port.value());
}

// A ROUTER and a DEALER bridge exchange envelopes both ways over `endpoint`.
void exchange_both_ways(const std::string& endpoint) {
  inbox coord_in, node_in;
  zmq_bridge coordinator(test_options(), coord_in.handler());
  zmq_bridge node(test_options(), node_in.handler());

  auto bound = coordinator.add_router("nodes", endpoint);
  ASSERT_TRUE(bound) << bound.message();
  auto connected = node.add_dealer("coordinator", connectable_endpoint(bound.value()), "node/alpha");
  ASSERT_TRUE(connected) << connected.message();

  ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/alpha", 1)));
  auto up = coord_in.next();
  ASSERT_TRUE(up);
  EXPECT_EQ(up->link, "nodes");
  EXPECT_EQ(up->peer, "node/alpha");
  EXPECT_EQ(up->env.sender(), "node/alpha");
  EXPECT_EQ(up->env.heartbeat().seq(), 1u);

  auto ack = make_envelope(envelope_header{wire::protocol_version, "job-1", "coordinator", 5}, 3);
  ack.mutable_heartbeat_ack()->set_seq(1);
  ASSERT_TRUE(coordinator.send("nodes", up->peer, ack));
  auto down = node_in.next();
  ASSERT_TRUE(down);
  EXPECT_EQ(down->link, "coordinator");
  EXPECT_EQ(down->peer, "");
  EXPECT_EQ(down->env.heartbeat_ack().seq(), 1u);

  // Many messages, in order, each way.
  for (uint64_t i = 2; i < 200; ++i) ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/alpha", i)));
  for (uint64_t i = 2; i < 200; ++i) {
    auto r = coord_in.next();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->env.heartbeat().seq(), i);
  }
  EXPECT_EQ(coordinator.stats().received, 199u);
  EXPECT_EQ(node.stats().sent, 199u);
  EXPECT_EQ(coordinator.stats().dropped_total(), 0u);
}

TEST(zmq_bridge, exchange_over_tcp) { exchange_both_ways(tcp_endpoint()); }

TEST(zmq_bridge, exchange_over_tcp_wildcard_port) { exchange_both_ways("tcp://127.0.0.1:*"); }

TEST(zmq_bridge, exchange_over_ipc) {
  testing::temp_dir dir;
  exchange_both_ways("ipc://" + dir.path() + "/node.sock");
}

TEST(zmq_bridge, dealer_sends_before_router_exists_are_delivered_once_it_binds) {
  const auto endpoint = tcp_endpoint();
  inbox coord_in, node_in;
  zmq_bridge node(test_options(), node_in.handler());
  ASSERT_TRUE(node.add_dealer("coordinator", endpoint, "node/early"));
  ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/early", 1)));

  zmq_bridge coordinator(test_options(), coord_in.handler());
  ASSERT_TRUE(coordinator.add_router("nodes", endpoint));
  auto r = coord_in.next();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->peer, "node/early");
}

TEST(zmq_bridge, invalid_frames_are_counted_dropped_and_do_not_stall_the_receiver) {
  inbox coord_in;
  zmq_bridge coordinator(test_options(), coord_in.handler(), coord_in.drop_handler());
  auto bound = coordinator.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();

  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.set(zmq::sockopt::routing_id, "evil");
  raw.connect(bound.value());

  auto send_one = [&](const std::string& bytes) { raw.send(zmq::buffer(bytes), zmq::send_flags::none); };
  send_one("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff");           // garbage
  send_one("");                                                        // empty
  auto old = heartbeat("evil", 1);
  old.set_protocol_version(99);
  send_one(bytes_of(old));                                             // version
  send_one(bytes_of(heartbeat("evil", 2, "job-other")));               // foreign job
  raw.send(zmq::str_buffer("part1"), zmq::send_flags::sndmore);        // multipart junk
  raw.send(zmq::str_buffer("part2"), zmq::send_flags::none);
  const std::string valid = bytes_of(heartbeat("evil", 3));
  raw.send(zmq::buffer(valid), zmq::send_flags::sndmore);              // valid, but 3 frames
  raw.send(zmq::buffer(valid), zmq::send_flags::sndmore);
  raw.send(zmq::buffer(valid), zmq::send_flags::none);
  send_one("\x0a\x05hello\x12");  // truncated: parses partially, then fails
  send_one(valid);                                                     // finally a good one

  // Frames on one connection arrive in order, so once the valid one is
  // delivered every junk frame before it has been judged.
  auto r = coord_in.next();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->env.heartbeat().seq(), 3u);
  EXPECT_EQ(r->peer, "evil");
  auto s = coordinator.stats();
  EXPECT_EQ(s.dropped_of(wire::drop_kind::garbage), 2u);
  EXPECT_EQ(s.dropped_of(wire::drop_kind::empty), 1u);
  EXPECT_EQ(s.dropped_of(wire::drop_kind::version_mismatch), 1u);
  EXPECT_EQ(s.dropped_of(wire::drop_kind::foreign_job), 1u);
  EXPECT_EQ(s.dropped_of(wire::drop_kind::bad_multipart), 2u);
  EXPECT_EQ(s.dropped_total(), 7u);
  EXPECT_EQ(s.received, 1u);

  // A job id learnt later applies from then on.
  coordinator.set_job_id("job-2");
  send_one(valid);
  ASSERT_TRUE(coord_in.wait_drops(wire::drop_kind::foreign_job, 2));
  send_one(bytes_of(heartbeat("evil", 4, "job-2")));
  auto after = coord_in.next();
  ASSERT_TRUE(after);
  EXPECT_EQ(after->env.heartbeat().seq(), 4u);
}

// A node follows one coordinator at a time: once a coordinator of a newer
// lease epoch spoke, the messages of an older one (a deposed coordinator,
// partitioned) are dropped and counted as stale_epoch.
TEST(zmq_bridge, a_dealer_drops_messages_of_an_older_lease_epoch_than_one_it_heard) {
  inbox coord_in, node_in;
  zmq_bridge coordinator(test_options(), coord_in.handler());
  zmq_bridge node(test_options(), node_in.handler(), node_in.drop_handler());
  auto bound = coordinator.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  ASSERT_TRUE(node.add_dealer("coordinator", connectable_endpoint(bound.value()), "node/alpha"));
  ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/alpha", 1)));
  ASSERT_TRUE(coord_in.next());
  auto from_epoch = [](uint64_t epoch, uint64_t seq) {
    auto env = heartbeat("coordinator", seq);
    env.set_epoch(epoch);
    return env;
  };
  for (const auto& [epoch, seq] : std::vector<std::pair<uint64_t, uint64_t>>{{2, 10}, {1, 11}, {3, 12}, {2, 13}, {0, 14}, {3, 15}})
    ASSERT_TRUE(coordinator.send("nodes", "node/alpha", from_epoch(epoch, seq)));
  std::vector<uint64_t> heard;
  for (int i = 0; i < 3; ++i) {
    auto r = node_in.next();
    ASSERT_TRUE(r);
    heard.push_back(r->env.heartbeat().seq());
  }
  EXPECT_EQ(heard, (std::vector<uint64_t>{10, 12, 15}));
  EXPECT_EQ(node.stats().dropped_of(wire::drop_kind::stale_epoch), 3u);
}

// The seqs of the heartbeats `from` received, until none came for `quiet`.
std::vector<uint64_t> drain_seqs(inbox& from, std::chrono::milliseconds quiet) {
  std::vector<uint64_t> seqs;
  while (auto r = from.next(quiet)) seqs.push_back(r->env.heartbeat().seq());
  return seqs;
}

// A node given a coordinator and its standby (two endpoints) speaks to the
// one that last spoke at the newest lease epoch, not to both in turn: an
// old leader that is stopped but keeps its connection open gets nothing.
// Before anyone spoke, and once the leader's connection closed, every
// endpoint that is up gets each message; a registration always does.
TEST(zmq_bridge, a_dealer_of_several_endpoints_sends_to_the_newest_epochs_endpoint_only) {
  inbox a_in, b_in, node_in;
  zmq_bridge a(test_options(), a_in.handler());
  auto b = std::make_unique<zmq_bridge>(test_options(), b_in.handler());
  zmq_bridge node(test_options(), node_in.handler());
  auto a_bound = a.add_router("nodes", "tcp://127.0.0.1:*");
  auto b_bound = b->add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(a_bound && b_bound);
  ASSERT_TRUE(node.add_dealer("coordinator", connectable_endpoint(a_bound.value()) + "," + connectable_endpoint(b_bound.value()), "node/alpha"));
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (node.stats().handshakes_succeeded < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(node.stats().handshakes_succeeded, 2u);

  ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/alpha", 1)));
  EXPECT_EQ(drain_seqs(a_in, 300ms), (std::vector<uint64_t>{1}));
  EXPECT_EQ(drain_seqs(b_in, 300ms), (std::vector<uint64_t>{1}));

  auto from_epoch = [](uint64_t epoch, uint64_t seq) {
    auto env = heartbeat("coordinator", seq);
    env.set_epoch(epoch);
    return env;
  };
  ASSERT_TRUE(a.send("nodes", "node/alpha", from_epoch(1, 10)));
  ASSERT_TRUE(node_in.next());
  ASSERT_TRUE(b->send("nodes", "node/alpha", from_epoch(2, 20)));
  ASSERT_TRUE(node_in.next());
  std::vector<uint64_t> sent;
  for (uint64_t seq = 100; seq < 140; ++seq) {
    ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/alpha", seq)));
    sent.push_back(seq);
  }
  EXPECT_EQ(drain_seqs(b_in, 300ms), sent);
  EXPECT_EQ(drain_seqs(a_in, 100ms), std::vector<uint64_t>{}) << "the old leader got messages meant for the new one";

  auto registration = heartbeat("node/alpha", 0);
  registration.mutable_register_node()->set_node_id("alpha");
  ASSERT_TRUE(node.send("coordinator", "", registration));
  ASSERT_TRUE(a_in.next());
  ASSERT_TRUE(b_in.next());

  // The leader's connection closes: the others get what follows.
  b.reset();
  bool reached_a = false;
  for (uint64_t seq = 200; seq < 400 && !reached_a; ++seq) {
    ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/alpha", seq)));
    reached_a = a_in.next(50ms).has_value();
  }
  EXPECT_TRUE(reached_a) << "nothing reached the remaining endpoint after the leader's connection closed";
}

// A standby binds its address only once it holds the lease; its nodes
// dial it meanwhile. Each endpoint of a DEALER to several is dialled every
// reconnect interval without backing off, and a connection that comes up
// is reported (a node registers there at once): the node finds the new
// leader within a reconnect interval of its listening, not after a backoff
// grown while the standby stood by (from 20 ms to 1.3 s here, 5 s at most).
TEST(zmq_bridge, a_dealer_of_several_endpoints_finds_a_late_listener_within_a_reconnect_interval) {
  inbox leader_in, standby_in, node_in;
  auto o = test_options();
  o.reconnect_ivl_max_ms = 5000;  // a single endpoint's backoff
  zmq_bridge leader(o, leader_in.handler());
  zmq_bridge node(o, node_in.handler(), nullptr, nullptr, nullptr, node_in.connected_handler());
  auto bound = leader.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound);
  const std::string leader_endpoint = connectable_endpoint(bound.value()), standby_endpoint = tcp_endpoint();
  ASSERT_TRUE(node.add_dealer("coordinator", leader_endpoint + "," + standby_endpoint, "node/alpha"));
  auto up = node_in.next();
  ASSERT_TRUE(up);
  EXPECT_EQ(up->link, "connected");
  EXPECT_EQ(up->peer, leader_endpoint);
  // The standby stands by: every dial to its address is refused (backed
  // off, dials at about 0.65, 1.3 and 2.6 s).
  std::this_thread::sleep_for(1500ms);

  zmq_bridge standby(o, standby_in.handler());
  const auto listening = std::chrono::steady_clock::now();
  ASSERT_TRUE(standby.add_router("nodes", standby_endpoint));
  up = node_in.next();
  const auto found = std::chrono::steady_clock::now() - listening;
  ASSERT_TRUE(up);
  EXPECT_EQ(up->link, "connected");
  EXPECT_EQ(up->peer, standby_endpoint);
  EXPECT_LT(found, 700ms) << "the node's connection to the standby came up "
                          << std::chrono::duration_cast<std::chrono::milliseconds>(found).count() << " ms after it listened";
  auto registration = heartbeat("node/alpha", 0);
  registration.mutable_register_node()->set_node_id("alpha");
  ASSERT_TRUE(node.send("coordinator", "", registration));
  ASSERT_TRUE(standby_in.next());
}

// A node given a coordinator and its standby registers at once, before
// any connection's handshake completed (and the standby does not listen
// yet): the registration has nowhere to go. That is counted, as every drop
// is, but not logged: it is no error (the node registers again as a
// connection comes up), and a first line saying "dropped" reads as one.
TEST(zmq_bridge, a_dealer_of_several_endpoints_counts_without_a_line_what_it_sends_before_any_connection_is_up) {
  inbox node_in;
  zmq_bridge node(test_options(), node_in.handler(), node_in.drop_handler());
  ::testing::internal::CaptureStderr();
  const bool added = static_cast<bool>(node.add_dealer("coordinator", tcp_endpoint() + "," + tcp_endpoint(), "node/alpha"));
  auto registration = heartbeat("node/alpha", 0);
  registration.mutable_register_node()->set_node_id("alpha");
  const bool sent = node.send("coordinator", "", registration) && node.send("coordinator", "", heartbeat("node/alpha", 1));
  const bool counted = node_in.wait_drops(wire::drop_kind::send_overflow, 2);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(added && sent && counted);
  EXPECT_EQ(node.stats().dropped_of(wire::drop_kind::send_overflow), 2u);
  EXPECT_EQ(node.stats().sent, 0u);
  EXPECT_EQ(said, "") << "a send before any connection was up was logged";
}

// A connection is up but its queue is full (a coordinator that does not
// read): that is an overflow, and it is logged, once.
TEST(zmq_bridge, a_dealer_of_several_endpoints_logs_a_full_queue_while_a_connection_is_up) {
  zmq::context_t context(1);
  zmq::socket_t deaf(context, zmq::socket_type::router);  // never reads
  deaf.set(zmq::sockopt::rcvhwm, 1);
  deaf.set(zmq::sockopt::rcvbuf, 64 << 10);  // no autotuning: the kernel holds little for it
  deaf.set(zmq::sockopt::linger, 0);
  deaf.bind("tcp://127.0.0.1:*");
  inbox node_in;
  auto o = test_options();
  o.send_hwm = 1;
  zmq_bridge node(o, node_in.handler(), node_in.drop_handler());
  ASSERT_TRUE(node.add_dealer("coordinator", deaf.get(zmq::sockopt::last_endpoint) + "," + tcp_endpoint(), "node/alpha"));
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (node.stats().handshakes_succeeded < 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(node.stats().handshakes_succeeded, 1u);
  auto big = heartbeat("node/alpha", 0);
  big.mutable_register_node()->set_node_id(std::string(1 << 20, 'x'));  // the socket buffers fill in a few
  ::testing::internal::CaptureStderr();
  bool sent = true;
  for (int i = 0; i < 64; ++i) sent = sent && node.send("coordinator", "", big);
  const bool counted = node_in.wait_drops(wire::drop_kind::send_overflow, 1);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(sent && counted);
  EXPECT_NE(said.find("dtactor: wire: dropped send_overflow frame, link 'coordinator': cannot send register_node: the queue of every connection up"),
            std::string::npos)
      << said;
  EXPECT_EQ(said.find("peer '"), std::string::npos) << "a DEALER link's peer has no routing id to name\n" << said;
}

TEST(zmq_bridge, a_router_reports_a_peers_closed_connection_after_what_it_sent) {
  inbox coord_in, alpha_in, beta_in;
  zmq_bridge coordinator(test_options(), coord_in.handler(), nullptr, nullptr, coord_in.closed_handler());
  auto bound = coordinator.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  auto alpha = std::make_unique<zmq_bridge>(test_options(), alpha_in.handler());
  zmq_bridge beta(test_options(), beta_in.handler());
  ASSERT_TRUE(alpha->add_dealer("coordinator", connectable_endpoint(bound.value()), "node/alpha"));
  ASSERT_TRUE(beta.add_dealer("coordinator", connectable_endpoint(bound.value()), "node/beta"));
  ASSERT_TRUE(beta.send("coordinator", "", heartbeat("node/beta", 1)));
  auto first = coord_in.next();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->peer, "node/beta");
  for (uint64_t i = 1; i <= 5; ++i) ASSERT_TRUE(alpha->send("coordinator", "", heartbeat("node/alpha", i)));
  alpha->stop(std::chrono::seconds(2));  // its sockets close: the kernel ends the connection
  alpha.reset();
  for (uint64_t i = 1; i <= 5; ++i) {
    auto r = coord_in.next();
    ASSERT_TRUE(r);
    EXPECT_EQ(r->link, "nodes");
    EXPECT_EQ(r->env.heartbeat().seq(), i);
  }
  auto closed = coord_in.next();
  ASSERT_TRUE(closed);
  EXPECT_EQ(closed->link, "closed");
  EXPECT_EQ(closed->peer, "node/alpha");
  // The other peer's connection is untouched.
  ASSERT_TRUE(beta.send("coordinator", "", heartbeat("node/beta", 2)));
  auto after = coord_in.next();
  ASSERT_TRUE(after);
  EXPECT_EQ(after->peer, "node/beta");
  EXPECT_EQ(after->env.heartbeat().seq(), 2u);
}

TEST(zmq_bridge, oversized_frame_is_refused_and_the_receiver_keeps_working) {
  inbox coord_in;
  auto options = test_options();
  options.max_message_bytes = 1024;
  zmq_bridge coordinator(options, coord_in.handler());
  auto bound = coordinator.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();

  // ZeroMQ drops the connection of a peer sending an oversized frame; the
  // peer reconnects, and its next frames get through.
  zmq::context_t ctx;
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.set(zmq::sockopt::routing_id, "big");
  raw.set(zmq::sockopt::reconnect_ivl, 10);
  raw.connect(bound.value());
  const std::string huge(64 * 1024, 'x');
  raw.send(zmq::buffer(huge), zmq::send_flags::none);

  // Frames written right behind the huge one may be lost with its
  // connection, so repeat the valid one until it arrives.
  const std::string valid = bytes_of(heartbeat("big", 1));
  std::optional<received> r;
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (!r && std::chrono::steady_clock::now() < deadline) {
    raw.send(zmq::buffer(valid), zmq::send_flags::dontwait);
    r = coord_in.next(50ms);
  }
  ASSERT_TRUE(r);
  EXPECT_EQ(r->peer, "big");
  EXPECT_GE(coordinator.stats().received, 1u);
}

TEST(zmq_bridge, send_to_unknown_peer_is_counted_not_fatal) {
  inbox coord_in;
  zmq_bridge coordinator(test_options(), coord_in.handler(), coord_in.drop_handler());
  ASSERT_TRUE(coordinator.add_router("nodes", "tcp://127.0.0.1:*"));
  ASSERT_TRUE(coordinator.send("nodes", "node/nobody", heartbeat("coordinator", 1)));
  ASSERT_TRUE(coord_in.wait_drops(wire::drop_kind::unroutable, 1));
  EXPECT_EQ(coordinator.stats().dropped_of(wire::drop_kind::unroutable), 1u);
  EXPECT_EQ(coordinator.stats().sent, 0u);
  // Still usable.
  ASSERT_TRUE(coordinator.send("nodes", "node/nobody", heartbeat("coordinator", 2)));
  ASSERT_TRUE(coord_in.wait_drops(wire::drop_kind::unroutable, 2));
}

TEST(zmq_bridge, send_errors_the_caller_can_know_now) {
  inbox in;
  zmq_bridge bridge(test_options(), in.handler());
  auto no_link = bridge.send("nowhere", "", heartbeat("x", 1));
  ASSERT_FALSE(no_link);
  EXPECT_NE(no_link.message().find("no such link"), std::string::npos);
  ASSERT_TRUE(bridge.add_router("nodes", "tcp://127.0.0.1:*"));
  auto no_body = bridge.send("nodes", "p", make_envelope(envelope_header{wire::protocol_version, "", "x", 1}, 0));
  EXPECT_FALSE(no_body);
  EXPECT_FALSE(bridge.add_router("nodes", "tcp://127.0.0.1:*")) << "duplicate link name";
  EXPECT_FALSE(bridge.add_dealer("d", "tcp://127.0.0.1:1", "")) << "empty routing id";
  ASSERT_TRUE(bridge.remove_link("nodes"));
  EXPECT_FALSE(bridge.send("nodes", "p", heartbeat("x", 1)));
  bridge.stop();
  auto stopped = bridge.send("nodes", "p", heartbeat("x", 1));
  ASSERT_FALSE(stopped);
  auto add_after_stop = bridge.add_router("late", "tcp://127.0.0.1:*");
  ASSERT_FALSE(add_after_stop);
  EXPECT_NE(add_after_stop.message().find("stopped"), std::string::npos);
}

TEST(zmq_bridge, bind_errors_are_clear_values) {
  inbox a_in, b_in;
  zmq_bridge a(test_options(), a_in.handler());
  zmq_bridge b(test_options(), b_in.handler());
  auto bound = a.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();

  auto taken = b.add_router("nodes", bound.value());
  ASSERT_FALSE(taken);
  EXPECT_NE(taken.message().find("Address already in use"), std::string::npos) << taken.message();
  EXPECT_NE(taken.message().find(bound.value()), std::string::npos) << taken.message();

  auto bad = b.add_router("bad", "tcp://not an endpoint");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("cannot bind link 'bad'"), std::string::npos) << bad.message();

  auto transport = b.add_router("bad2", "carrier-pigeon://x");
  ASSERT_FALSE(transport);
  std::fprintf(stderr, "[messages] %s\n[messages] %s\n[messages] %s\n", taken.message().c_str(),
               bad.message().c_str(), transport.message().c_str());

  // b still works after the failures.
  EXPECT_TRUE(b.add_router("ok", "tcp://127.0.0.1:*"));
}

TEST(zmq_bridge, stop_is_prompt_with_pending_work) {
  inbox in;
  zmq_bridge bridge(test_options(), in.handler());
  // A dealer dialing a port nobody listens on, with messages queued for it.
  auto port = pick_free_tcp_port();
  ASSERT_TRUE(port);
  ASSERT_TRUE(bridge.add_dealer("coordinator", "tcp://127.0.0.1:" + std::to_string(port.value()), "n"));
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(bridge.send("coordinator", "", heartbeat("n", i)));
  const auto t0 = std::chrono::steady_clock::now();
  bridge.stop();
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 500ms);
  bridge.stop();  // idempotent
}

TEST(zmq_bridge, handler_may_send_replies) {
  inbox node_in;
  zmq_bridge* self = nullptr;
  zmq_bridge coordinator(test_options(), [&](const std::string& link, const std::string& peer, pb::envelope env) {
    auto ack = make_envelope(envelope_header{wire::protocol_version, "job-1", "coordinator", 1}, 3);
    ack.mutable_heartbeat_ack()->set_seq(env.heartbeat().seq());
    ASSERT_TRUE(self->send(link, peer, ack));
  });
  self = &coordinator;
  auto bound = coordinator.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound);
  zmq_bridge node(test_options(), node_in.handler());
  ASSERT_TRUE(node.add_dealer("coordinator", bound.value(), "node/echo"));
  ASSERT_TRUE(node.send("coordinator", "", heartbeat("node/echo", 42)));
  auto r = node_in.next();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->env.heartbeat_ack().seq(), 42u);
}

TEST(zmq_bridge, address_helpers) {
  EXPECT_EQ(connectable_endpoint("tcp://0.0.0.0:29400"), "tcp://127.0.0.1:29400");
  EXPECT_EQ(connectable_endpoint("tcp://*:29400", "10.1.2.3"), "tcp://10.1.2.3:29400");
  EXPECT_EQ(connectable_endpoint("tcp://192.168.1.4:29400"), "tcp://192.168.1.4:29400");
  EXPECT_EQ(connectable_endpoint("ipc:///tmp/x.sock"), "ipc:///tmp/x.sock");
  auto p = pick_free_tcp_port();
  ASSERT_TRUE(p);
  EXPECT_GT(p.value(), 0);
  EXPECT_LT(p.value(), 65536);
  EXPECT_EQ(printable_routing_id("node/a"), "node/a");
  EXPECT_EQ(printable_routing_id(std::string("\0\x01\xab", 3)), "0x0001ab");
}

}  // namespace
}  // namespace dtactor
