// Warm spare rank processes (cluster.spare_ranks, a node's --spares) with
// real processes on loopback: a killed rank process whose place a spare
// takes (the world back at full size in one generation, no shrink first), a
// spare that is itself killed and replaced, a node with a spare joining a
// running job, and a stop with spares waiting. Each test waits for journal
// events or the node's /metrics, never for fixed times.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <fstream>
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
using testing::descendants;
using testing::eventually;
using testing::expect_finished_without_loss;
using testing::job_sets;
using testing::journal_events;
using testing::journal_events_named;
using testing::temp_dir;
using json = nlohmann::json;

// A metric of a node's /metrics (no labels), or -1.
double node_metric(int port, const std::string& name) {
  std::smatch m;
  const std::string scrape = test_support::http_get(port, "/metrics");
  const std::regex re("\n" + name + "(\\{[^}]*\\})? ([-0-9.e+]+)");
  return std::regex_search(scrape, m, re) ? std::stod(m[2]) : -1.0;
}

// The node's rank processes (spare = false) or its waiting spares.
std::vector<pid_t> processes(cluster& cl, const std::string& node, bool spare) { return testing::rank_processes(cl.nodes.at(node).pid(), spare); }

int free_port() { return pick_free_tcp_port().value(); }

// A node with a metrics port, to watch its spares.
std::vector<std::string> metrics_flags(int port, const std::vector<std::string>& more = {}) {
  std::vector<std::string> f = {"--metrics-port", std::to_string(port), "--metrics-addr", "127.0.0.1"};
  f.insert(f.end(), more.begin(), more.end());
  return f;
}

bool spare_warm(int port, int n = 1) { return node_metric(port, "dtactor_spare_ranks") == n; }

// Kills node `node`'s one rank process; the journal must then show its
// place taken by a spare: rank_exited with spare, and one recovery at full
// size (`world`) with spare_ranks 1, no generation smaller in between.
void kill_rank_and_expect_spare(cluster& cl, const std::string& node, int world) {
  const auto before = cl.journal().size();
  auto ranks = processes(cl, node, false);
  ASSERT_EQ(ranks.size(), 1u);
  ASSERT_EQ(::kill(ranks[0], SIGKILL), 0);
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) {
    for (size_t i = before; i < j.size(); ++i)
      if (j[i].at("event") == "recovery_done") return true;
    return false;
  })) << cl.logs();
  auto j = cl.journal();
  std::vector<json> after(j.begin() + static_cast<std::ptrdiff_t>(before), j.end());
  auto exited = journal_events_named(after, ev::rank_down::exited_name);
  ASSERT_EQ(exited.size(), 1u) << cl.logs();
  EXPECT_EQ(exited[0].value("spare", false), true) << exited[0].dump();
  auto rec = journal_events<ev::recovery_done>(after);
  ASSERT_FALSE(rec.empty());
  EXPECT_EQ(rec[0].at("world_size"), world) << rec[0].dump();
  EXPECT_EQ(rec[0].value("spare_ranks", 0), 1) << rec[0].dump();
  EXPECT_EQ(rec[0].at("lost_steps"), 0) << rec[0].dump();
  for (const auto& g : journal_events<ev::generation_started>(after)) EXPECT_EQ(g.at("world_size"), world) << "shrank first: " << g.dump();
}

// The coordinator, node a, and node b with one spare and its metrics on
// `port`; "" once the job trained `step` steps at world 2 and b's spare is
// warm, else what went wrong.
std::string start_with_a_spare_on_b(cluster& cl, int port, int64_t step) {
  if (auto e = cl.start_coordinator(); !e.empty()) return e;
  if (auto e = cl.start_node("a"); !e.empty()) return e;
  if (auto e = cl.start_node("b", metrics_flags(port, {"--spares", "1"})); !e.empty()) return e;
  if (!cl.wait_step(step, 2)) return "no step " + std::to_string(step) + " at world 2\n" + cl.logs();
  if (!eventually([&] { return spare_warm(port); })) return "b's spare did not warm up\n" + cl.logs();
  return "";
}

TEST(Spares, AKilledRankProcessIsReplacedByAWarmSpareAtFullSize) {
  temp_dir d;
  cluster cl(d.path(), job_sets(3000, {"cluster.min_nodes=2"}));
  const int port = free_port();
  ASSERT_EQ(start_with_a_spare_on_b(cl, port, 30), "");
  const auto spare = processes(cl, "b", true);
  ASSERT_EQ(spare.size(), 1u);
  kill_rank_and_expect_spare(cl, "b", 2);
  // The spare is b's rank now (the same process), and the pool is refilled.
  auto ranks = processes(cl, "b", false);
  EXPECT_TRUE(ranks.empty() || std::find(ranks.begin(), ranks.end(), spare[0]) == ranks.end());
  EXPECT_EQ(node_metric(port, "dtactor_spare_takeovers_total"), 1);
  EXPECT_TRUE(eventually([&] { return spare_warm(port) && processes(cl, "b", true).size() == 2u; })) << cl.logs();
  expect_finished_without_loss(cl, 3000, 2);
}

TEST(Spares, ASpareThatIsKilledIsReplacedWithoutDisturbingTraining) {
  temp_dir d;
  cluster cl(d.path(), job_sets(3000, {"cluster.min_nodes=2"}));
  const int port = free_port();
  ASSERT_EQ(start_with_a_spare_on_b(cl, port, 20), "");
  auto first = processes(cl, "b", true);
  ASSERT_EQ(first.size(), 1u);
  const auto generations = journal_events<ev::generation_started>(cl.journal()).size();
  ASSERT_EQ(::kill(first[0], SIGKILL), 0);
  ASSERT_TRUE(eventually([&] { return node_metric(port, "dtactor_spare_ranks") == 0; })) << cl.logs();
  // Another spare starts and warms up.
  ASSERT_TRUE(eventually([&] {
    auto now = processes(cl, "b", true);
    return spare_warm(port) && now.size() == 1u && now[0] != first[0];
  })) << cl.logs();
  // Training never noticed: no new generation.
  EXPECT_EQ(journal_events<ev::generation_started>(cl.journal()).size(), generations) << cl.logs();
  // ... and the new spare takes a rank's place.
  kill_rank_and_expect_spare(cl, "b", 2);
  expect_finished_without_loss(cl, 3000, 2);
}

TEST(Spares, ANodeWithASpareJoinsARunningJobAndItsSpareTakesOver) {
  temp_dir d;
  // The job's config asks every node for a spare (cluster.spare_ranks).
  cluster cl(d.path(), job_sets(3000, {"cluster.spare_ranks=1"}));
  const int port = free_port();
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_TRUE(cl.wait_step(20, 1)) << cl.logs();
  ASSERT_EQ(cl.start_node("b", metrics_flags(port)), "");
  // The spare is no rank of the job: the world is the nodes' ranks, 2.
  ASSERT_TRUE(cl.wait_step(60, 2)) << cl.logs();
  ASSERT_TRUE(eventually([&] { return spare_warm(port); })) << cl.logs();
  for (const auto& g : journal_events<ev::generation_started>(cl.journal())) EXPECT_LE(g.at("world_size").get<int>(), 2) << g.dump();
  kill_rank_and_expect_spare(cl, "b", 2);
  expect_finished_without_loss(cl, 3000, 2);
}

TEST(Spares, AStopWithSparesWaitingEndsEveryProcess) {
  temp_dir d;
  cluster cl(d.path(), job_sets(100000, {"cluster.min_nodes=2", "checkpoint.every_steps=100000", "cluster.spare_ranks=1"}));
  const int pa = free_port(), pb = free_port();
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a", metrics_flags(pa)), "");
  ASSERT_EQ(cl.start_node("b", metrics_flags(pb)), "");
  ASSERT_TRUE(cl.wait_step(20, 2)) << cl.logs();
  ASSERT_TRUE(eventually([&] { return spare_warm(pa) && spare_warm(pb); })) << cl.logs();
  std::vector<pid_t> all;
  for (const char* n : {"a", "b"})
    for (pid_t p : descendants(cl.nodes.at(n).pid())) all.push_back(p);
  ASSERT_EQ(all.size(), 4u);  // a rank and a spare each
  cl.coord->signal(SIGTERM);
  auto done = cl.coord->wait(60000);
  ASSERT_TRUE(done) << cl.logs();
  EXPECT_EQ(done->exit_code, 128 + SIGTERM) << done->describe();
  auto stopped = journal_events<ev::job_stopped>(cl.journal());
  ASSERT_EQ(stopped.size(), 1u) << cl.logs();
  EXPECT_FALSE(stopped[0].contains("error")) << stopped[0].dump();
  EXPECT_EQ(stopped[0].at("world_size"), 2) << stopped[0].dump();
  for (auto& [id, n] : cl.nodes) {
    auto e = n.wait(20000);
    ASSERT_TRUE(e) << "node " << id << " did not stop\n" << cl.logs();
    EXPECT_EQ(e->exit_code, 0) << id << ": " << e->describe() << "\n" << cl.logs();
  }
  // Every rank and spare ended with its node (reaped: no /proc entry left).
  for (pid_t p : all) EXPECT_FALSE(std::filesystem::exists("/proc/" + std::to_string(p) + "/cmdline") && testing::is_spare_process(p)) << p;
}

}  // namespace
}  // namespace dtactor
