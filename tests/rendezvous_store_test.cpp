// The torch-free rendezvous store (server) and its c10d::Store client:
// every operation, blocking and timeouts, garbage from strangers, and a
// Gloo process group built over it.
#include "net/rendezvous_store.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdio>
#include <thread>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "comm/communicator.hpp"
#include "comm/rendezvous_client.hpp"

namespace dtactor {
namespace {

using namespace std::chrono_literals;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& v) { return {v.begin(), v.end()}; }

struct store_fixture : ::testing::Test {
  void SetUp() override {
    auto s = rendezvous_store::start(0, 10s);
    ASSERT_TRUE(s) << s.message();
    server = std::move(s.value());
    ASSERT_GT(server->port(), 0);
  }
  c10::intrusive_ptr<rendezvous_client> client(std::chrono::milliseconds timeout = 5s) {
    return c10::make_intrusive<rendezvous_client>("127.0.0.1", server->port(), timeout);
  }
  std::unique_ptr<rendezvous_store> server;
};

TEST_F(store_fixture, EveryOperation) {
  auto c = client();
  c->set("a", bytes("alpha"));
  EXPECT_EQ(text(c->get("a")), "alpha");
  c->set("a", bytes(std::string("b\0c", 3)));
  EXPECT_EQ(c->get("a").size(), 3u);

  EXPECT_EQ(c->add("n", 5), 5);
  EXPECT_EQ(c->add("n", -2), 3);
  EXPECT_EQ(text(c->get("n")), "3");  // stored as text, as TCPStore does

  // compareSet as TCPStore: absent key + empty expected creates it; absent +
  // other expected returns expected; present returns what is stored now.
  EXPECT_EQ(text(c->compareSet("cas", {}, bytes("v1"))), "v1");
  EXPECT_EQ(text(c->compareSet("cas", bytes("wrong"), bytes("v2"))), "v1");
  EXPECT_EQ(text(c->compareSet("cas", bytes("v1"), bytes("v2"))), "v2");
  EXPECT_EQ(text(c->compareSet("absent", bytes("x"), bytes("y"))), "x");
  EXPECT_FALSE(c->check({"absent"}));

  EXPECT_TRUE(c->check({"a", "n", "cas"}));
  EXPECT_FALSE(c->check({"a", "nope"}));
  EXPECT_EQ(c->getNumKeys(), 3);
  EXPECT_TRUE(c->deleteKey("a"));
  EXPECT_FALSE(c->deleteKey("a"));
  EXPECT_EQ(c->getNumKeys(), 2);
  c->wait({"n", "cas"});
  c->wait({"n"}, 100ms);

  // A second client sees the same keys.
  EXPECT_EQ(text(client()->get("cas")), "v2");
}

TEST_F(store_fixture, GetBlocksUntilAnotherClientSetsTheKey) {
  auto getter = client();
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    client()->set("late", bytes("here"));
  });
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(text(getter->get("late")), "here");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 250ms);
  setter.join();
}

TEST_F(store_fixture, WaitIsReleasedWhenAllKeysExist) {
  auto waiter = client();
  std::thread setter([&] {
    auto c = client();
    c->set("k1", bytes("1"));
    std::this_thread::sleep_for(200ms);
    c->add("k2", 1);
  });
  waiter->wait({"k1", "k2"}, 5s);
  setter.join();
  EXPECT_TRUE(waiter->check({"k1", "k2"}));
}

TEST_F(store_fixture, TimeoutsThrowAndTheClientStaysUsable) {
  auto c = client(300ms);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(c->get("never"), rendezvous_error);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  try {
    c->wait({"never"}, 200ms);
    FAIL() << "wait did not throw";
  } catch (const rendezvous_error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  // The late answers of the requests given up on (the key arrives now) must
  // not be taken for the answers of the next ones.
  client()->set("never", bytes("now"));
  c->set("x", bytes("1"));
  EXPECT_EQ(text(c->get("x")), "1");
  EXPECT_EQ(text(c->get("never")), "now");
}

TEST(RendezvousStore, AnUnreachableStoreIsATimeout) {
  int port = 0;
  {
    auto s = rendezvous_store::start(0, 1s);
    ASSERT_TRUE(s) << s.message();
    port = s.value()->port();
  }  // stopped: nobody listens there now
  auto c = c10::make_intrusive<rendezvous_client>("127.0.0.1", port, 300ms);
  // Its own type (what the rank's group builder tells from other failures
  // by), a c10::Error for c10d's callers, and it names the store.
  try {
    c->set("k", bytes("v"));
    FAIL() << "set did not throw";
  } catch (const rendezvous_error& e) {
    const std::string what = e.what_without_backtrace();
    EXPECT_EQ(what.rfind("rendezvous store at tcp://127.0.0.1:" + std::to_string(port) + ": set timed out", 0), 0u) << what;
  }
  EXPECT_THROW(c->set("k", bytes("v")), c10::Error);
}

TEST(RendezvousStore, APortInUseIsOneLine) {
  auto a = rendezvous_store::start(0, 1s);
  ASSERT_TRUE(a) << a.message();
  auto b = rendezvous_store::start(a.value()->port(), 1s);
  ASSERT_FALSE(b);
  EXPECT_NE(b.message().find("cannot start the rendezvous store on port"), std::string::npos) << b.message();
}

TEST_F(store_fixture, GarbageFromStrangersIsIgnored) {
  const std::string ep = "tcp://127.0.0.1:" + std::to_string(server->port());
  zmq::context_t ctx;
  // Well-framed ZeroMQ messages that are not requests.
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.connect(ep);
  const std::vector<std::vector<std::string>> junk = {
      {"x"},
      {"12345678"},
      {"short", "set", "k", "v"},
      {"12345678", "bogus"},
      {"12345678", "set", "only-key"},
      {"12345678", "add", "k", "not-a-number"},
      {"12345678", "get", "k", "-5"},
      {"12345678", "wait", "soon", "k"},
      {std::string(8, '\xff'), "num", "extra"},
  };
  for (const auto& frames : junk) {
    zmq::multipart_t m;
    for (const auto& f : frames) m.addstr(f);
    m.send(d);
  }
  // A peer that does not speak ZMTP at all.
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_GE(fd, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(server->port()));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
      const char noise[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n\x00\xff\x01garbage";
      (void)!::write(fd, noise, sizeof noise);
    }
    ::close(fd);
  }
  // A string key is fine even if it once held garbage; a non-number add fails cleanly.
  auto c = client();
  c->set("text", bytes("abc"));
  EXPECT_THROW(c->add("text", 1), rendezvous_error);
  c->set("k", bytes("v"));
  EXPECT_EQ(text(c->get("k")), "v");
  EXPECT_EQ(c->getNumKeys(), 2);
}

// Three ranks as threads build a Gloo group over the store, as ranks of a
// generation do over the coordinator's, and allreduce.
TEST_F(store_fixture, GlooGroupOverTheStore) {
  constexpr int world = 3;
  std::vector<torch::Tensor> results(world);
  std::vector<std::string> errors(world);
  auto run = [&](int rank) {
    communicator_options o;
    o.generation = 3;
    o.timeout = 20s;
    auto pg = make_process_group(client(20s), rank, world, o);
    if (!pg) {
      errors[rank] = pg.message();
      return;
    }
    std::vector<torch::Tensor> t{torch::full({5}, static_cast<float>(rank + 1))};
    pg.value()->allreduce(t)->wait();
    results[rank] = t[0];
  };
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back(run, r);
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(errors[r].empty()) << errors[r];
    EXPECT_TRUE(torch::equal(results[r], torch::full({5}, 6.f)));
  }
}

// What Gloo's rendezvous stores, measured against the store's limits
// (rendezvous_limits_for): each rank one value listing its address for
// every peer (~136 bytes a peer), so a group of W ranks ~136 W^2 bytes.
// Eight ranks as threads build one group over the store.
TEST_F(store_fixture, GlooGroupFitsTheStoreLimits) {
  constexpr int world = 8;
  std::vector<std::string> errors(world);
  auto run = [&](int rank) {
    communicator_options o;
    o.generation = 5;
    o.timeout = 60s;
    auto pg = make_process_group(client(60s), rank, world, o);
    if (!pg) {
      errors[rank] = pg.message();
      return;
    }
    std::vector<torch::Tensor> t{torch::ones({4})};
    pg.value()->allreduce(t)->wait();
  };
  std::vector<std::thread> ts;
  for (int r = 0; r < world; ++r) ts.emplace_back(run, r);
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) ASSERT_TRUE(errors[r].empty()) << errors[r];
  // The store thread publishes its figures each round (at most 50 ms).
  std::this_thread::sleep_for(200ms);
  const auto u = server->usage();
  const auto limits = rendezvous_limits_for(world);
  std::printf("Gloo group of %d over the store: %zu keys, %zu bytes (%.0f a rank pair), the largest value %zu bytes (%.0f a peer); "
              "limits for world %d: %zu a value, %zu in all\n",
              world, u.keys, u.bytes, static_cast<double>(u.bytes) / (world * world), u.largest_value,
              static_cast<double>(u.largest_value) / (world - 1), world, limits.max_value_bytes, limits.max_total_bytes);
  EXPECT_EQ(u.refused, 0u);
  EXPECT_LE(u.largest_value, 256u * world) << "a value grows by more than the 256 bytes a rank the limits allow";
  EXPECT_LE(u.bytes, 256u * world * world + 64u * 1024) << "the group stores more than the limits' 256 W^2";
}

}  // namespace
}  // namespace dtactor
