// A warm standby node (cluster.standby_nodes) with real processes on
// loopback: three nodes for a world of two; the third waits outside, its
// rank warmed up; kill -9 of a member node (the node and its rank), and the
// standby takes its place in one recovery at full size, without a lost
// step. Waits for journal events and the coordinator's /status.json, never
// for fixed times.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "chaos_checks.hpp"
#include "cluster_harness.hpp"
#include "net/zmq_bridge.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::cluster;
using testing::eventually;
using testing::expect_finished_without_loss;
using testing::job_sets;
using testing::journal_events;
using testing::temp_dir;
using json = nlohmann::json;

// The coordinator's status page says of node `id`: its ready ranks (-1:
// not a member) and whether it trains (in the plan).
std::pair<int, std::string> member(int port, const std::string& id) {
  const std::string response = test_support::http_get(port, "/status.json");
  const auto body = response.find("\r\n\r\n");
  if (body == std::string::npos) return {-1, ""};
  const auto j = json::parse(response.substr(body + 4), nullptr, false);
  if (j.is_discarded() || !j.contains("members")) return {-1, ""};
  for (const auto& m : j.at("members"))
    if (m.value("node", "") == id) return {m.value("ready_ranks", -1), m.value("state", "")};
  return {-1, ""};
}

// A metric of the coordinator's /metrics, or -1.
double metric(int port, const std::string& name) {
  std::smatch m;
  const std::string scrape = test_support::http_get(port, "/metrics");
  const std::regex re("\n" + name + "(\\{[^}]*\\})? ([-0-9.e+]+)");
  return std::regex_search(scrape, m, re) ? std::stod(m[2]) : -1.0;
}

std::vector<json> since(const std::vector<json>& j, size_t from) { return {j.begin() + static_cast<std::ptrdiff_t>(from), j.end()}; }

TEST(StandbyNodes, AKilledMemberNodeIsReplacedByTheWarmStandbyInOneRecovery) {
  temp_dir d;
  cluster cl(d.path(), job_sets(3000, {"cluster.min_nodes=2", "cluster.max_nodes=2", "cluster.standby_nodes=1"}));
  const int port = pick_free_tcp_port().value();
  ASSERT_EQ(cl.start_coordinator({"--metrics-port", std::to_string(port), "--metrics-addr", "127.0.0.1"}), "");
  ASSERT_EQ(cl.start_node("x"), "");
  ASSERT_EQ(cl.start_node("y"), "");
  ASSERT_TRUE(cl.wait_step(20, 2)) << cl.logs();
  const auto generations = journal_events<ev::generation_started>(cl.journal()).size();
  ASSERT_EQ(cl.start_node("z"), "");
  // z is admitted and its rank warmed up (ready), but it is not planned in.
  ASSERT_TRUE(eventually([&] { return member(port, "z").first == 1; })) << cl.logs();
  ASSERT_TRUE(cl.wait_step(40, 2)) << cl.logs();
  EXPECT_EQ(journal_events<ev::generation_started>(cl.journal()).size(), generations) << "z was planned in while it should wait";
  EXPECT_NE(member(port, "z").second, "training");

  const auto before = cl.journal().size();
  cl.signal_node("x", SIGKILL);
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) { return !journal_events<ev::recovery_done>(since(j, before)).empty(); })) << cl.logs();
  const auto after = since(cl.journal(), before);
  auto started = journal_events<ev::generation_started>(after);
  ASSERT_EQ(started.size(), 1u) << "more than one re-plan (a shrink first?)\n" << cl.logs();
  EXPECT_EQ(started[0].at("world_size"), 2) << started[0].dump();
  EXPECT_EQ(started[0].at("nodes"), json({"y", "z"})) << started[0].dump();
  EXPECT_EQ(started[0].value("standby_promoted", json::array()), json({"z"})) << started[0].dump();
  auto rec = journal_events<ev::recovery_done>(after);
  EXPECT_EQ(rec[0].at("world_size"), 2) << rec[0].dump();
  EXPECT_EQ(rec[0].at("lost_steps"), 0) << rec[0].dump();
  EXPECT_EQ(metric(port, "dtactor_standby_promotions_total"), 1);
  expect_finished_without_loss(cl, 3000, 2);
}

// A node started with --standby-node waits outside a world that has room
// (cluster.standby_nodes is 0, max_nodes 64) and takes a killed member's
// place in one recovery; the status page calls it `standby` until then.
TEST(StandbyNodes, ANodeStartedWithTheFlagWaitsOutsideARoomyWorldAndReplacesAKilledMember) {
  temp_dir d;
  cluster cl(d.path(), job_sets(3000, {"cluster.min_nodes=2"}));
  const int port = pick_free_tcp_port().value();
  ASSERT_EQ(cl.start_coordinator({"--metrics-port", std::to_string(port), "--metrics-addr", "127.0.0.1"}), "");
  ASSERT_EQ(cl.start_node("x"), "");
  ASSERT_EQ(cl.start_node("y"), "");
  ASSERT_EQ(cl.start_node("z", {"--standby-node"}), "");
  ASSERT_TRUE(eventually([&] { return member(port, "z") == std::make_pair(1, std::string("standby")); })) << cl.logs();
  ASSERT_TRUE(cl.wait_step(40, 2)) << cl.logs();
  EXPECT_EQ(member(port, "z").second, "standby");
  for (const auto& g : journal_events<ev::generation_started>(cl.journal())) EXPECT_EQ(g.at("world_size"), 2) << g.dump();

  const auto before = cl.journal().size();
  cl.signal_node("x", SIGKILL);
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) { return !journal_events<ev::recovery_done>(since(j, before)).empty(); })) << cl.logs();
  auto started = journal_events<ev::generation_started>(since(cl.journal(), before));
  ASSERT_EQ(started.size(), 1u) << cl.logs();
  auto nodes = started[0].at("nodes").get<std::vector<std::string>>();
  std::sort(nodes.begin(), nodes.end());  // by node rank: registration order
  EXPECT_EQ(nodes, (std::vector<std::string>{"y", "z"})) << started[0].dump();
  EXPECT_EQ(started[0].value("standby_promoted", json::array()), json({"z"})) << started[0].dump();
  expect_finished_without_loss(cl, 3000, 2);
}

}  // namespace
}  // namespace dtactor
