// Heartbeat relays (actors/relays.hpp) with real coordinator and node
// processes on loopback: relays on from 2 members, 2 nodes a group, so
// that of w, x, y, z (node ranks 0..3) w relays for x and y for z. A
// relay stopped (a machine that vanished: SIGSTOP, nothing closes) is lost
// to silence alone; its member goes back to the coordinator in time and is
// never lost; the job finishes without a lost step. Waits for journal
// events and log lines, never for fixed times.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "chaos_checks.hpp"
#include "cluster_harness.hpp"
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

std::string node_log(const cluster& cl, const std::string& id) {
  std::ifstream f(cl.run_dir + "/node-" + id + ".log");
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Relays, AStoppedRelayIsLostToSilenceAloneItsMemberGoesBackToTheCoordinatorAndNoStepIsLost) {
  temp_dir d;
  cluster cl(d.path(), job_sets(400, {"cluster.min_nodes=4", "cluster.relay_from_nodes=2", "cluster.relay_group_size=2"}));
  ASSERT_EQ(cl.start_coordinator(), "");
  // One at a time, so that node ranks follow the order.
  for (std::string id : {"w", "x", "y", "z"}) {
    ASSERT_EQ(cl.start_node(id), "");
    ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) {
      for (const auto& e : journal_events<ev::node_joined>(j))
        if (e.at("node") == id) return true;
      return false;
    })) << cl.logs();
  }
  ASSERT_TRUE(cl.wait_step(30, 4)) << cl.logs();
  // x beats w, z beats y (the agents say where their beats go).
  ASSERT_TRUE(eventually([&] { return node_log(cl, "x").find("heartbeats go to relay 'w'") != std::string::npos; })) << cl.logs();
  ASSERT_TRUE(eventually([&] { return node_log(cl, "z").find("heartbeats go to relay 'y'") != std::string::npos; })) << cl.logs();
  EXPECT_EQ(node_log(cl, "w").find("heartbeats go to relay"), std::string::npos);

  const auto before = cl.journal().size();
  cl.signal_node("w", SIGSTOP);
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) {
    return !journal_events<ev::node_lost>({j.begin() + static_cast<std::ptrdiff_t>(before), j.end()}).empty();
  })) << cl.logs();
  ASSERT_TRUE(cl.wait_step(120, 3)) << cl.logs();
  const auto j = cl.journal();
  const auto lost = journal_events<ev::node_lost>({j.begin() + static_cast<std::ptrdiff_t>(before), j.end()});
  ASSERT_EQ(lost.size(), 1u) << cl.logs();
  EXPECT_EQ(lost[0].at("node"), "w");
  EXPECT_EQ(lost[0].at("cause"), "heartbeat_timeout") << lost[0].dump();
  EXPECT_LE(lost[0].at("detected_after_s").get<double>(), 1.3) << lost[0].dump();
  EXPECT_NE(node_log(cl, "x").find("relay 'w' did not answer"), std::string::npos) << node_log(cl, "x");
  cl.signal_node("w", SIGKILL);
  expect_finished_without_loss(cl, 400, 3);
}

}  // namespace
}  // namespace dtactor
