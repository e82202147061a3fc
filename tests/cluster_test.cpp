// The cluster runtime end to end: real coordinator and node processes (and
// their rank processes) on loopback, started from the built dtactor binary.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <fstream>
#include <regex>
#include <thread>
#include <zmq.hpp>

#include "http_get.hpp"
#include "runtime/process.hpp"
#include "runtime/zmq_bridge.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::events;
using testing::read_journal;
using testing::temp_dir;

const std::string kBin = DTACTOR_BINARY;

std::vector<std::string> tiny_sets(int steps) {
  std::vector<std::string> out;
  for (const std::string s : {"model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2", "train.global_batch_size=32",
                              "train.warmup_steps=5", "train.lr=0.003", "eval.max_samples=500", "eval.every_steps=0",
                              "checkpoint.every_steps=10", "train.log_every_steps=5", "cluster.digest_every_steps=5"}) {
    out.push_back("--set");
    out.push_back(s);
  }
  out.push_back("--set");
  out.push_back("train.max_steps=" + std::to_string(steps));
  return out;
}

// Value of an unlabelled-or-labelled sample line "name{...} value" in a scrape.
double metric_value(const std::string& scrape, const std::string& name_regex) {
  std::smatch m;
  std::regex re("\n" + name_regex + "(\\{[^}]*\\})? ([-0-9.e+]+)");
  if (std::regex_search(scrape, m, re)) return std::stod(m[2]);
  return -1;
}

// A coordinator (with /metrics) and two nodes (node 0 with /metrics) started
// as separate processes, as a user would on two machines.
struct two_node_cluster {
  std::string endpoint;
  int coord_metrics = 0, node_metrics = 0;
  std::optional<child_process> coord;
  std::vector<child_process> nodes;
  std::string error;

  two_node_cluster(const std::string& run_dir, int steps) {
    const int port = pick_free_tcp_port().value();
    coord_metrics = pick_free_tcp_port().value();
    node_metrics = pick_free_tcp_port().value();
    endpoint = "tcp://127.0.0.1:" + std::to_string(port);
    std::vector<std::string> cargs = {kBin, "--role", "coordinator", "--listen", endpoint, "--run-dir", run_dir, "--metrics-port",
                                      std::to_string(coord_metrics), "--set", "cluster.min_nodes=2"};
    for (const auto& s : tiny_sets(steps)) cargs.push_back(s);
    auto c = child_process::spawn(cargs);
    if (!c) {
      error = c.message();
      return;
    }
    coord.emplace(std::move(c.value()));
    for (int i = 0; i < 2; ++i) {
      std::vector<std::string> nargs = {kBin, "--role", "node", "--coordinator", endpoint, "--node-id", "n" + std::to_string(i),
                                        "--advertise-addr", "127.0.0.1"};
      if (i == 0) nargs.insert(nargs.end(), {"--metrics-port", std::to_string(node_metrics)});
      auto n = child_process::spawn(nargs);
      if (!n) {
        error = n.message();
        return;
      }
      nodes.push_back(std::move(n.value()));
    }
  }
};

TEST(Cluster, TwoNodesTrainAgreeAndShrugOffGarbage) {
  temp_dir d;
  two_node_cluster cl(d.path(), 60);
  ASSERT_TRUE(cl.error.empty()) << cl.error;
  auto& coord = cl.coord;
  auto& nodes = cl.nodes;
  const std::string ep = cl.endpoint;
  const int mport = cl.coord_metrics, nport = cl.node_metrics;
  // Garbage and a peer from another job, straight at the coordinator's socket.
  {
    zmq::context_t ctx;
    zmq::socket_t s(ctx, zmq::socket_type::dealer);
    s.set(zmq::sockopt::linger, 1000);
    s.connect(ep);
    s.send(zmq::str_buffer("this is not a protobuf envelope"), zmq::send_flags::none);
    s.send(zmq::buffer(std::string("\x0a\x05junk!\xff\xff", 9)), zmq::send_flags::none);
  }
  // /metrics shows the job while it runs, the dropped frames included.
  double step = -1, world = -1, dropped = -1, node_step = -1, node_samples = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::chrono::steady_clock::now() < deadline && coord->running()) {
    const std::string scrape = test_support::http_get(mport, "/metrics");
    step = metric_value(scrape, "dtactor_step");
    world = metric_value(scrape, "dtactor_world_size");
    dropped = metric_value(scrape, "dtactor_wire_dropped_frames_total");
    const std::string node_scrape = test_support::http_get(nport, "/metrics");
    node_step = metric_value(node_scrape, "dtactor_step");
    node_samples = metric_value(node_scrape, "dtactor_samples_total");
    if (step > 0 && dropped >= 1 && node_step > 0) break;
    coord->wait(50);
  }
  EXPECT_GT(step, 0);
  EXPECT_EQ(world, 2);
  EXPECT_GE(dropped, 1);
  EXPECT_GT(node_step, 0);  // the node's own endpoint
  EXPECT_GT(node_samples, 0);
  auto done = coord->wait(120000);
  ASSERT_TRUE(done) << "coordinator did not finish";
  EXPECT_FALSE(done->signaled);
  EXPECT_EQ(done->exit_code, 0);
  for (auto& n : nodes) {
    auto e = n.wait(20000);
    ASSERT_TRUE(e) << "node did not stop after the job";
    EXPECT_EQ(e->exit_code, 0) << e->describe();
  }

  auto j = read_journal(d.path() + "/journal.jsonl");
  EXPECT_EQ(events(j, "node_joined").size(), 2u);
  auto gens = events(j, "generation_started");
  ASSERT_EQ(gens.size(), 1u);
  EXPECT_EQ(gens[0].at("world_size"), 2);
  auto steps = events(j, "step");
  ASSERT_GE(steps.size(), 10u);
  for (const auto& s : steps) EXPECT_EQ(s.at("world_size"), 2);
  EXPECT_LT(steps.back().at("loss").get<double>(), steps.front().at("loss").get<double>());
  EXPECT_GE(events(j, "checkpoint_saved").size(), 6u);
  auto fin = events(j, "job_finished");
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].at("step"), 60);
  EXPECT_FALSE(fin[0].contains("error")) << fin[0].dump();  // every rank ended with the same parameters
  EXPECT_TRUE(fin[0].contains("accuracy"));
}

TEST(Cluster, LocalModeRunsAWholeJob) {
  temp_dir d;
  std::vector<std::string> args = {kBin, "local", "--nodes", "2", "--nproc-per-node", "1", "--run-dir", d.path()};
  for (const auto& s : tiny_sets(20)) args.push_back(s);
  auto c = child_process::spawn(args);
  ASSERT_TRUE(c) << c.message();
  auto e = c->wait(120000);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->exit_code, 0) << e->describe();
  auto j = read_journal(d.path() + "/journal.jsonl");
  auto fin = events(j, "job_finished");
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].at("world_size"), 2);
  EXPECT_EQ(fin[0].at("step"), 20);
}

// An evaluation longer than a collective's timeout must not fail the ranks
// that are not evaluating (they used to wait in the next allreduce).
TEST(Cluster, LongEvaluationDoesNotTimeOutPeers) {
  temp_dir d;
  std::vector<std::string> args = {kBin, "local", "--nodes", "2", "--run-dir", d.path()};
  for (const auto& s : tiny_sets(10)) args.push_back(s);
  for (const std::string s : {"eval.every_steps=5", "eval.max_samples=0", "eval.batch_size=5", "cluster.collective_timeout_ms=100"}) {
    args.push_back("--set");
    args.push_back(s);
  }
  auto c = child_process::spawn(args);
  ASSERT_TRUE(c) << c.message();
  auto e = c->wait(120000);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->exit_code, 0) << e->describe();
  auto j = read_journal(d.path() + "/journal.jsonl");
  EXPECT_TRUE(events(j, "rank_failed").empty());
  auto evals = events(j, "eval");
  ASSERT_EQ(evals.size(), 2u);
  EXPECT_GT(evals[0].at("duration_s").get<double>(), 0.1);  // longer than the collective timeout
  EXPECT_EQ(events(j, "job_finished").size(), 1u);
}

// A later job in the same run directory resumes from the newest checkpoint
// (generation 1 gets it from disk through the root rank's broadcast).
TEST(Cluster, ResumesFromTheRunDirectory) {
  temp_dir d;
  auto run = [&](int steps) {
    std::vector<std::string> args = {kBin, "local", "--nodes", "2", "--run-dir", d.path()};
    for (const auto& s : tiny_sets(steps)) args.push_back(s);
    auto c = child_process::spawn(args);
    if (!c) return -1;
    auto e = c->wait(120000);
    return e ? e->exit_code : -1;
  };
  ASSERT_EQ(run(20), 0);
  ASSERT_EQ(run(30), 0);
  auto j = read_journal(d.path() + "/journal.jsonl");
  auto restored = events(j, "checkpoint_restored");
  ASSERT_EQ(restored.size(), 1u);
  EXPECT_EQ(restored[0].at("step"), 20);
  auto gens = events(j, "generation_started");
  ASSERT_EQ(gens.size(), 2u);
  EXPECT_EQ(gens[1].at("start_step"), 20);
  auto fin = events(j, "job_finished");
  ASSERT_EQ(fin.size(), 2u);
  EXPECT_EQ(fin[1].at("step"), 30);
  EXPECT_FALSE(fin[1].contains("error"));
}

// Existing torchrun-style launch scripts: the same environment on every node.
TEST(Cluster, TorchrunStyleEnvironmentLaunches) {
  temp_dir d;
  const int port = pick_free_tcp_port().value();
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("WORLD_SIZE", "2", 1);
  std::vector<child_process> nodes;
  for (int r = 0; r < 2; ++r) {
    ::setenv("NODE_RANK", std::to_string(r).c_str(), 1);
    std::vector<std::string> args = {kBin, "--role", "node", "--run-dir", d.path(), "--advertise-addr", "127.0.0.1"};
    for (const auto& s : tiny_sets(10)) args.push_back(s);
    auto n = child_process::spawn(args);
    ASSERT_TRUE(n) << n.message();
    nodes.push_back(std::move(n.value()));
  }
  for (const char* v : {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "NODE_RANK"}) ::unsetenv(v);
  for (auto& n : nodes) {
    auto e = n.wait(120000);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->exit_code, 0) << e->describe();
  }
  auto fin = events(read_journal(d.path() + "/journal.jsonl"), "job_finished");
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].at("world_size"), 2);
}

TEST(Cluster, UnreachableCoordinatorIsAClearError) {
  const int port = pick_free_tcp_port().value();  // nobody listens there
  auto n = child_process::spawn({kBin, "--role", "node", "--coordinator", "tcp://127.0.0.1:" + std::to_string(port), "--connect-timeout", "2"});
  ASSERT_TRUE(n) << n.message();
  auto e = n->wait(30000);
  ASSERT_TRUE(e) << "node kept waiting for an unreachable coordinator";
  EXPECT_EQ(e->exit_code, 1);
}

}  // namespace
}  // namespace dtactor
