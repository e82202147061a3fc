// Issue 47's hardening, the parts that need no process: peer text made
// printable, logs rate-limited per cause, the control plane's message limit
// measured against the largest real envelopes, the rendezvous store's
// limits, config files that are not files. The attacks themselves run as
// processes (tests/adversarial_test.py). Torch-free.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <thread>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "base/log_limiter.hpp"
#include "base/printable.hpp"
#include "dtactor/config.hpp"
#include "net/rendezvous_protocol.hpp"
#include "net/rendezvous_store.hpp"
#include "net/wire.hpp"
#include "net/zap_handler.hpp"
#include "net/zmq_bridge.hpp"
#include "base/job_key.hpp"
#include <zmq.hpp>
#include <atomic>
#include <mutex>
#include "test_util.hpp"

namespace dtactor {
namespace {

using namespace std::chrono_literals;

bool one_printable_line(const std::string& s) {
  for (unsigned char c : s)
    if (c < 0x20 || c == 0x7f) return false;
  return true;
}

TEST(Printable, EscapesWhatWouldBreakOrSteerALine) {
  EXPECT_EQ(printable("ip-10-0-3-17"), "ip-10-0-3-17");
  EXPECT_EQ(printable("a\nb"), "a\\x0ab");
  EXPECT_EQ(printable("\x1b[2Jgone"), "\\x1b[2Jgone");
  EXPECT_EQ(printable(std::string("nul\0cut", 7)), "nul\\x00cut");
  EXPECT_EQ(printable("del\x7f"), "del\\x7f");
  EXPECT_EQ(printable("caf\xc3\xa9"), "caf\xc3\xa9") << "valid UTF-8 stays";
  EXPECT_EQ(printable("bad\xc3("), "bad\\xc3(") << "a broken sequence";
  EXPECT_EQ(printable("\xed\xa0\x80"), "\\xed\\xa0\\x80") << "a surrogate";
  EXPECT_EQ(printable("\xc0\xaf"), "\\xc0\\xaf") << "an overlong '/'";
  EXPECT_EQ(printable("\xc2\x85"), "\\u{0085}") << "C1 next-line";
  EXPECT_EQ(printable("a\xe2\x80\xaez"), "a\\u{202e}z") << "right-to-left override";
  EXPECT_EQ(printable("x\xe2\x80\xa8y"), "x\\u{2028}y") << "line separator";
  const std::string once = printable("evil\x1b]0;title\x07\r\n");
  EXPECT_EQ(printable(once), once) << "escaping twice changes nothing";
}

TEST(Printable, CutsLongTextAndSaysHowLongItWas) {
  const std::string big(10 * 1024, 'a');
  const std::string shown = printable(big);
  EXPECT_EQ(shown, std::string(printable_max_chars, 'a') + "...(10240 bytes)");
  // An escape is never split by the cut.
  const std::string escapes(1000, '\n');
  const std::string e = printable(escapes, 10);
  EXPECT_EQ(e, "\\x0a\\x0a...(1000 bytes)");
  EXPECT_EQ(printable(big, 0).size(), big.size()) << "0: no cut";
  // Whatever the bytes, one bounded printable line.
  std::string all;
  for (int i = 0; i < 10240; ++i) all += static_cast<char>(i * 7 % 256);
  const std::string line = printable(all);
  EXPECT_TRUE(one_printable_line(line));
  EXPECT_LE(line.size(), printable_max_chars + 32);
}

struct fake_clock {
  log_limiter::clock::time_point t{};
  std::function<log_limiter::clock::time_point()> fn() {
    return [this] { return t; };
  }
};

TEST(LogLimiter, ABurstThenALineAnIntervalSayingHowManyWereHeldBack) {
  fake_clock clock;
  std::vector<std::string> lines;
  log_limiter limit([&](const std::string& l) { lines.push_back(l); }, {3, 1000ms, 4}, clock.fn());
  for (int i = 0; i < 100; ++i) limit.log("garbage", "garbage " + std::to_string(i));
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(limit.held_back(), 97u);
  // Another cause is not held up by the flood of the first.
  EXPECT_TRUE(limit.log("handshake", "handshake 0"));
  clock.t += 999ms;
  EXPECT_FALSE(limit.log("garbage", "garbage 100"));
  clock.t += 1ms;
  EXPECT_TRUE(limit.log("garbage", "garbage 101"));
  EXPECT_EQ(lines.back(), "garbage 101 (98 similar lines not logged)");
  clock.t += 1000ms;
  EXPECT_TRUE(limit.log("garbage", "garbage 102"));
  EXPECT_EQ(lines.back(), "garbage 102");
  // Causes beyond max_causes share one budget.
  for (int c = 0; c < 100; ++c) limit.log("cause " + std::to_string(c), "x");
  EXPECT_LE(lines.size(), 5u + 2u + 3u + 3u);
}

// The largest control messages the protocol sends, measured against
// max_control_message_bytes: the plan a coordinator sends for a world of
// 1,000 nodes x 8 ranks with the largest config it sends, and the plan a
// node reports in register_node (without the config).
pb::envelope big_plan(int nodes, int ranks_per_node, std::size_t id_chars, std::size_t config_bytes) {
  pb::envelope env;
  env.set_protocol_version(wire::protocol_version);
  env.set_job_id("job-0123456789abcdef");
  env.set_sender("coordinator");
  env.set_incarnation(~uint64_t{0});
  env.set_generation(123456);
  auto* p = env.mutable_generation_plan();
  p->set_generation(123456);
  p->set_world_size(nodes * ranks_per_node);
  p->set_store_host("coordinator-host.example.internal");
  p->set_store_port(65535);
  for (int n = 0; n < nodes; ++n) {
    std::string id = "node-" + std::to_string(n);
    id += std::string(id_chars - id.size(), 'x');
    for (int r = 0; r < ranks_per_node; ++r) {
      auto* a = p->add_ranks();
      a->set_node_id(id);
      a->set_local_rank(r);
      a->set_global_rank(n * ranks_per_node + r);
      a->set_host_ranks(ranks_per_node);
    }
  }
  p->set_start_step(int64_t{1} << 40);
  p->set_state_root(4095);
  p->set_config_toml(std::string(config_bytes, 'c'));
  p->set_checkpoint_store("s3://a-bucket-of-checkpoints/with/a/long/prefix/for/this/job");
  p->set_checkpoint_step(int64_t{1} << 40);
  p->set_module_object("module-0123456789abcdef.pt");
  p->set_module_digest("123456789:0123456789abcdef");
  return env;
}

TEST(ControlMessages, TheLargestPlansFitTheControlPlanesLimitWithHeadroom) {
  const auto limit = static_cast<std::size_t>(wire::max_control_message_bytes);
  struct { int nodes, ranks; std::size_t id, config; const char* what; } cases[] = {
      {1000, 8, 64, max_config_bytes, "plan, 1,000 nodes x 8 ranks, 64-character ids, 256 KiB config"},
      {1000, 8, 128, max_config_bytes, "plan, 1,000 nodes x 8 ranks, 128-character ids, 256 KiB config"},
      {1000, 8, 128, 0, "registration's plan, 1,000 nodes x 8 ranks, 128-character ids"},
  };
  for (const auto& c : cases) {
    auto bytes = wire::encode(big_plan(c.nodes, c.ranks, c.id, c.config));
    ASSERT_TRUE(bytes) << bytes.message();
    std::printf("%s: %zu bytes (%.0f%% of the %zu-byte limit)\n", c.what, bytes->size(), 100.0 * bytes->size() / limit, limit);
    EXPECT_LT(bytes->size() * 10, limit * 8) << c.what << ": under 80% of the limit";
  }
}

TEST(ControlMessages, TheBridgeRefusesToSendAnEnvelopeOverTheLimit) {
  zmq_bridge_options o;
  o.max_message_bytes = 64 * 1024;
  zmq_bridge b(o, [](const std::string&, const std::string&, pb::envelope) {});
  ASSERT_TRUE(b.add_router("nodes", "tcp://127.0.0.1:*"));
  auto st = b.send("nodes", "someone", big_plan(10, 8, 16, 128 * 1024));
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("over the control plane's limit of 65536 bytes"), std::string::npos) << st.message();
  EXPECT_TRUE(b.send("nodes", "someone", big_plan(10, 8, 16, 1024))) << "a small one goes";
}

// Strangers refused by CURVE before ZAP sees them are counted by reason,
// and the handler hears each with the peer's address.
TEST(Handshakes, ARefusedStrangerIsCountedByReasonWithItsAddress) {
  auto key = generate_job_key();
  auto other = generate_job_key();
  ASSERT_TRUE(key && other);
  zmq_bridge_options o;
  o.key = std::make_shared<const job_key>(key.value());
  std::mutex mu;
  std::vector<std::string> addresses;
  zmq_bridge b(o, [](const std::string&, const std::string&, pb::envelope) {}, nullptr,
               [&](const std::string&, bool router, handshake_failure, const std::string& address) {
                 std::lock_guard<std::mutex> lock(mu);
                 if (router) addresses.push_back(address);
               });
  auto bound = b.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  zmq::context_t ctx;
  auto dial = [&](const job_key* k, const std::string& server_public) {
    auto s = std::make_unique<zmq::socket_t>(ctx, zmq::socket_type::dealer);
    s->set(zmq::sockopt::linger, 0);
    if (k) make_curve_client(*s, server_public, k->client_public, k->client_secret);
    s->connect(bound.value());
    s->send(zmq::str_buffer("hello"), zmq::send_flags::dontwait);
    return s;
  };
  auto none = dial(nullptr, "");                                       // no key at all
  auto foreign = dial(&other.value(), other->server_public);           // another job's keys
  auto half = dial(&other.value(), key->server_public);                // our server key, a stranger's client key (ZAP)
  auto count = [&](handshake_failure f) { return b.stats().handshake_failures[static_cast<std::size_t>(f)]; };
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  // A keyless libzmq peer that sees our CURVE greeting first hangs up
  // before sending its mechanism: that reads as bad_frame here (no_key on
  // its side); a raw one that sends its greeting whole is no_key.
  auto keyless = [&] { return count(handshake_failure::no_key) + count(handshake_failure::bad_frame); };
  while ((keyless() == 0 || count(handshake_failure::unknown_key) < 2) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(10ms);
  EXPECT_GE(keyless(), 1u);
  EXPECT_GE(count(handshake_failure::unknown_key), 2u) << "another job's key, and a client key ZAP refuses";
  EXPECT_EQ(b.stats().received, 0u);
  // The address is the peer's as the monitor read it when the connection
  // was accepted: a connection refused and closed before that (a loaded
  // machine) has none ("?"). More strangers until one carries it.
  auto carried = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return std::any_of(addresses.begin(), addresses.end(), [](const std::string& a) { return a.rfind("127.0.0.1:", 0) == 0; });
  };
  std::vector<std::unique_ptr<zmq::socket_t>> more;
  while (!carried() && std::chrono::steady_clock::now() < deadline) {
    more.push_back(dial(&other.value(), other->server_public));
    std::this_thread::sleep_for(50ms);
  }
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_FALSE(addresses.empty());
  EXPECT_TRUE(std::any_of(addresses.begin(), addresses.end(), [](const std::string& a) { return a.rfind("127.0.0.1:", 0) == 0; }))
      << "no failure carried the peer's address";
}

// A plain TCP connection to 127.0.0.1:port (-1 on failure), with a receive
// timeout so that reads below never hang.
int raw_connect(int port, const char* from = nullptr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (from) {
    sockaddr_in src{};
    src.sin_family = AF_INET;
    ::inet_pton(AF_INET, from, &src.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&src), sizeof src) != 0) {
      ::close(fd);
      return -1;
    }
  }
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{0, 100 * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// True once the server has closed the connection (a read sees its end).
bool closed_by_server(int fd) {
  char buf[512];
  for (;;) {
    const auto n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return true;
    if (n < 0) return false;  // nothing more for now: still open
  }
}

int port_of_endpoint(const std::string& ep) { return std::stoi(ep.substr(ep.rfind(':') + 1)); }

// Connections that stay in their handshake are bounded: beyond
// max_pending_handshakes, each is shut down as it is accepted (counted as
// `busy`), long before the handshake limit; once they are gone, a holder of
// the key gets in.
TEST(Handshakes, ConnectionsBeyondTheLimitInTheirHandshakeAreShedAsTheyCome) {
  auto key = generate_job_key();
  ASSERT_TRUE(key);
  zmq_bridge_options o;
  o.key = std::make_shared<const job_key>(key.value());
  o.max_pending_handshakes = 4;
  o.max_pending_handshakes_per_address = 4;
  o.handshake_timeout_ms = 60000;  // so that only the gate can close them within the test
  std::atomic<int> received{0};
  zmq_bridge b(o, [&](const std::string&, const std::string&, pb::envelope) { received.fetch_add(1); });
  auto bound = b.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  const int port = port_of_endpoint(bound.value());
  std::vector<int> fds;
  for (int i = 0; i < 12; ++i) {
    const int fd = raw_connect(port);
    ASSERT_GE(fd, 0);
    fds.push_back(fd);
  }
  auto busy = [&] { return b.stats().handshake_failures[static_cast<std::size_t>(handshake_failure::busy)]; };
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  std::size_t closed = 0;
  std::vector<bool> seen(fds.size(), false);
  while ((closed < 8 || busy() < 8) && std::chrono::steady_clock::now() < deadline) {
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (!seen[i] && closed_by_server(fds[i])) seen[i] = true, ++closed;
  }
  EXPECT_EQ(closed, 8u) << "12 connections in their handshake, 4 allowed";
  EXPECT_EQ(busy(), 8u);
  while (b.stats().handshakes_in_progress != 4u && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(b.stats().handshakes_in_progress, 4u) << "the first four, still in their handshake";
  for (int fd : fds) ::close(fd);
  // The flood is gone: a holder of the key connects and is heard.
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  make_curve_client(s, key->server_public, key->client_public, key->client_secret);
  s.connect(bound.value());
  pb::envelope env;
  env.set_protocol_version(wire::protocol_version);
  env.mutable_heartbeat();
  auto bytes = wire::encode(env);
  ASSERT_TRUE(bytes);
  const auto until = std::chrono::steady_clock::now() + 20s;
  while (received.load() == 0 && std::chrono::steady_clock::now() < until) {
    s.send(zmq::buffer(bytes.value()), zmq::send_flags::dontwait);
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_GE(received.load(), 1) << "a real peer got in after the flood";
}

// One address cannot take every place in the handshake: beyond its share
// its connections are shed, and another address's still get in.
TEST(Handshakes, OneAddressCannotTakeEveryPlaceInTheHandshake) {
  auto key = generate_job_key();
  ASSERT_TRUE(key);
  zmq_bridge_options o;
  o.key = std::make_shared<const job_key>(key.value());
  o.max_pending_handshakes = 6;
  o.max_pending_handshakes_per_address = 2;
  o.handshake_timeout_ms = 60000;
  zmq_bridge b(o, [](const std::string&, const std::string&, pb::envelope) {});
  auto bound = b.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  const int port = port_of_endpoint(bound.value());
  std::vector<int> flood, other;
  for (int i = 0; i < 5; ++i) flood.push_back(raw_connect(port, "127.0.0.1"));
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  auto busy = [&] { return b.stats().handshake_failures[static_cast<std::size_t>(handshake_failure::busy)]; };
  while (busy() < 3 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(busy(), 3u) << "five from one address, two allowed";
  for (int i = 0; i < 2; ++i) other.push_back(raw_connect(port, "127.0.0.2"));
  for (int fd : other) ASSERT_GE(fd, 0);
  while (b.stats().handshakes_in_progress < 4 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(b.stats().handshakes_in_progress, 4u);
  EXPECT_EQ(busy(), 3u) << "another address's connections were shed";
  for (int fd : other) EXPECT_FALSE(closed_by_server(fd));
  for (int fd : flood) ::close(fd);
  for (int fd : other) ::close(fd);
}

// Garbage on a keyed socket is refused at the greeting, where libzmq emits
// no failure event of its own: it is still counted, with the address.
TEST(Handshakes, GarbageRefusedAtTheGreetingIsCountedWithItsAddress) {
  auto key = generate_job_key();
  ASSERT_TRUE(key);
  zmq_bridge_options o;
  o.key = std::make_shared<const job_key>(key.value());
  std::mutex mu;
  std::vector<std::string> addresses;
  zmq_bridge b(o, [](const std::string&, const std::string&, pb::envelope) {}, nullptr,
               [&](const std::string&, bool, handshake_failure why, const std::string& address) {
                 std::lock_guard<std::mutex> lock(mu);
                 if (why == handshake_failure::bad_frame) addresses.push_back(address);
               });
  auto bound = b.add_router("nodes", "tcp://127.0.0.1:*");
  ASSERT_TRUE(bound) << bound.message();
  const int fd = raw_connect(port_of_endpoint(bound.value()));
  ASSERT_GE(fd, 0);
  // Once the bridge has seen the connection accepted, it knows its address.
  const auto accepted_by = std::chrono::steady_clock::now() + 20s;
  while (b.stats().handshakes_in_progress == 0 && std::chrono::steady_clock::now() < accepted_by) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(b.stats().handshakes_in_progress, 1u);
  const std::string garbage = "GET / HTTP/1.0\r\n\r\n";
  ASSERT_EQ(::send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL), static_cast<ssize_t>(garbage.size()));
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  auto heard = [&] {
    std::lock_guard<std::mutex> lock(mu);
    return !addresses.empty();
  };
  while (!heard() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  ::close(fd);
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(addresses.size(), 1u) << "the refused greeting was not reported";
  EXPECT_EQ(addresses[0].rfind("127.0.0.1:", 0), 0u) << addresses[0];
  while (b.stats().handshakes_in_progress != 0u && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(b.stats().handshakes_in_progress, 0u);
}

using message = rendezvous_table::message;
const std::string rid = rendezvous_protocol::encode_id(9);

std::vector<message> ask(rendezvous_table& t, std::vector<std::string> frames, std::string* refused = nullptr) {
  message m{"peer", rid};
  m.insert(m.end(), frames.begin(), frames.end());
  return t.handle(std::move(m), std::chrono::steady_clock::time_point{} + 1h, nullptr, refused);
}

TEST(RendezvousLimits, AValueOverItsLimitIsRefusedWithAReason) {
  rendezvous_table t(60s);
  const auto l = rendezvous_limits_for(0);
  std::string refused;
  auto r = ask(t, {"set", "k", std::string(l.max_value_bytes + 1, 'v')}, &refused);
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0][2], "err");
  EXPECT_NE(r[0][3].find("over the rendezvous store's limit of 65536 bytes a value"), std::string::npos) << r[0][3];
  EXPECT_FALSE(refused.empty());
  EXPECT_EQ(t.keys(), 0u);
  EXPECT_EQ(ask(t, {"set", "k", std::string(l.max_value_bytes, 'v')})[0][2], "ok");
  // cas may not grow a value past it either.
  EXPECT_EQ(ask(t, {"cas", "c", "", std::string(l.max_value_bytes + 1, 'v')})[0][2], "err");
}

TEST(RendezvousLimits, AFullStoreDropsOldGenerationsFirstThenRefuses) {
  rendezvous_table t(60s);
  const auto l = rendezvous_limits_for(0);
  const std::string value(l.max_value_bytes, 'v');
  const std::size_t per_entry = value.size() + rendezvous_entry_overhead + 8;
  const std::size_t fit = l.max_total_bytes / per_entry;
  // Generation 1 fills the store; generation 2's keys push it out.
  for (std::size_t i = 0; i < fit; ++i) ASSERT_EQ(ask(t, {"set", "g1/" + std::to_string(i + 10000), value})[0][2], "ok") << i;
  EXPECT_LE(t.bytes(), l.max_total_bytes);
  for (std::size_t i = 0; i < fit; ++i) ASSERT_EQ(ask(t, {"set", "g2/" + std::to_string(i + 10000), value})[0][2], "ok") << i;
  EXPECT_LE(t.bytes(), l.max_total_bytes);
  EXPECT_EQ(ask(t, {"check", "g1/10000"})[0][3], "0") << "generation 1 made room";
  // Keys outside any generation, or of the newest one, are never dropped:
  // beyond the limit a write is refused.
  std::string refused;
  std::vector<message> r;
  for (std::size_t i = 0; i < 4 && (r.empty() || r[0][2] == "ok"); ++i) r = ask(t, {"set", "x" + std::to_string(i), value}, &refused);
  ASSERT_EQ(r[0][2], "err");
  EXPECT_NE(r[0][3].find("the rendezvous store is full"), std::string::npos) << r[0][3];
  EXPECT_LE(t.bytes(), l.max_total_bytes);
  EXPECT_EQ(t.refused(), 1u);
  // A larger world raises the limits.
  t.set_limits(rendezvous_limits_for(1000));
  EXPECT_EQ(ask(t, {"set", "y", value})[0][2], "ok");
}

// On an open store anyone may write; keys of generations nobody planned go
// first when it is full, and the planned generation's keys never do.
TEST(RendezvousLimits, InventedGenerationsNeverPushOutThePlannedOnesKeys) {
  rendezvous_table t(60s);
  const auto l = rendezvous_limits_for(0);
  t.set_planned_generation(5);
  ASSERT_EQ(ask(t, {"set", "g5/rank0", "addr0"})[0][2], "ok");
  ASSERT_EQ(ask(t, {"set", "g4/rank0", "old"})[0][2], "ok");
  const std::string value(l.max_value_bytes, 'v');
  std::vector<message> r;
  for (std::size_t i = 0; i < 1000 && (r.empty() || r[0][2] == "ok"); ++i) r = ask(t, {"set", "g999999/" + std::to_string(i), value});
  ASSERT_EQ(r[0][2], "err") << "the flood's own generation is never evicted for itself";
  EXPECT_EQ(ask(t, {"check", "g4/rank0"})[0][3], "0") << "an older generation made room first";
  EXPECT_EQ(ask(t, {"check", "g5/rank0"})[0][3], "1") << "the planned generation's key was pushed out";
  // The running group's next write evicts the invented generation.
  EXPECT_EQ(ask(t, {"set", "g5/rank1", value})[0][2], "ok");
  EXPECT_EQ(ask(t, {"check", "g5/rank0", "g5/rank1"})[0][3], "1");
  EXPECT_LE(t.bytes(), l.max_total_bytes);
  // The generation after the planned one may be written before its plan is heard of: kept too.
  EXPECT_EQ(ask(t, {"set", "g6/rank0", "addr"})[0][2], "ok");
  r.clear();
  for (std::size_t i = 0; i < 1000 && (r.empty() || r[0][2] == "ok"); ++i) r = ask(t, {"set", "g777/" + std::to_string(i), value});
  EXPECT_EQ(ask(t, {"check", "g5/rank0", "g6/rank0"})[0][3], "1");
}

TEST(RendezvousLimits, ParkedRequestsAreBounded) {
  rendezvous_table t(60s);
  const auto l = rendezvous_limits_for(0);
  for (std::size_t i = 0; i < l.max_parked; ++i) ASSERT_TRUE(ask(t, {"get", "never" + std::to_string(i), "0"}).empty()) << i;
  auto r = ask(t, {"get", "one-more", "0"});
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0][2], "err");
  EXPECT_EQ(t.parked(), l.max_parked);
}

TEST(ConfigFiles, ADirectoryADeviceAndAHugeFileAreRefused) {
  testing::temp_dir dir;
  auto d = config::load(dir.path(), {});
  ASSERT_FALSE(d);
  EXPECT_NE(d.message().find("is not a regular file (a directory)"), std::string::npos) << d.message();
  auto z = config::load("/dev/zero", {});
  ASSERT_FALSE(z);
  EXPECT_NE(z.message().find("is not a regular file (a device, pipe or socket)"), std::string::npos) << z.message();
  const std::string big = dir.path() + "/big.toml";
  {
    std::ofstream f(big);
    f << "# " << std::string(max_config_bytes, 'x') << "\n";
  }
  auto b = config::load(big, {});
  ASSERT_FALSE(b);
  EXPECT_NE(b.message().find("over the limit of 262144 bytes"), std::string::npos) << b.message();
  const std::string ok = dir.path() + "/ok.toml";
  {
    std::ofstream f(ok);
    f << "[train]\nmax_steps = 7\n";
  }
  auto k = config::load(ok, {});
  ASSERT_TRUE(k) << k.message();
  EXPECT_EQ(k->get_int("train.max_steps"), 7);
}

}  // namespace
}  // namespace dtactor
