// The cloud's preemption notice with real processes: a coordinator and two
// nodes on loopback, node b watching a local metadata service
// (tests/fake_metadata.py) that speaks AWS IMDSv2, GCP or Azure Scheduled
// Events as documented. On the notice b leaves at a step boundary (0 steps
// lost), the job finishes at world 1, and the journal says when. A metadata
// service that never answers does not stop training.
#include <gtest/gtest.h>

#include <cstdlib>

#include "chaos_checks.hpp"
#include "test_util.hpp"

using namespace dtactor;
using namespace dtactor::testing;

namespace {

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct fake_metadata {
  std::optional<child_process> proc;
  int port = 0;
  std::string error;
  fake_metadata(const std::string& cloud, const std::string& dir) {
    const std::string port_file = dir + "/metadata-" + cloud + ".port";
    auto p = child_process::spawn({"/usr/bin/python3.11", DTACTOR_SOURCE_DIR "/tests/fake_metadata.py", "--cloud", cloud, "--port-file", port_file},
                                  false, dir + "/metadata-" + cloud + ".log");
    if (!p) {
      error = p.message();
      return;
    }
    proc.emplace(std::move(p.value()));
    // Wait for the server to say it listens (it writes the file after bind).
    for (int i = 0; i < 1000 && port == 0 && proc->running(); ++i) {
      std::ifstream f(port_file);
      if (!(f >> port)) port = 0;
      if (port == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (port == 0) error = "the fake metadata service did not start";
  }
  ~fake_metadata() {
    if (proc && proc->running()) proc->signal(SIGKILL);
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port); }
  std::string get(const std::string& path) const { return test_support::http_get(port, path); }
};

// Node b watches `cloud` at the fake service; after step 2 the notice is
// turned on.
void preempt_with(const std::string& cloud) {
  temp_dir d;
  fake_metadata md(cloud, d.path());
  ASSERT_EQ(md.error, "");
  // The clouds' SDK variables (the node inherits them); Azure's option.
  ::setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", md.url().c_str(), 1);
  ::setenv("GCE_METADATA_HOST", ("127.0.0.1:" + std::to_string(md.port)).c_str(), 1);
  cluster cl(d.path(), job_sets(300, {"cluster.min_nodes=2"}));
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_EQ(cl.start_node("b", {"--preemption-notice", cloud, "--azure-metadata-endpoint", md.url(), "--preemption-poll-ms", "100"}), "");
  ASSERT_TRUE(cl.wait_step(30, 2)) << cl.logs();
  ASSERT_NE(md.get("/__control/notice").find("ok"), std::string::npos);
  const auto t0 = std::chrono::steady_clock::now();
  auto e = cl.nodes.at("b").wait(30000);
  ASSERT_TRUE(e) << "the noticed node did not leave\n" << cl.logs();
  const double gone_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(e->exit_code, 0) << e->describe();
  expect_finished_without_loss(cl, 300, 1);
  auto j = cl.journal();
  auto pn = journal_events<ev::preemption_notice>(j);
  ASSERT_EQ(pn.size(), 1u) << cl.logs();
  EXPECT_EQ(pn[0].at("node"), "b");
  EXPECT_EQ(pn[0].at("cloud"), cloud);
  const double ahead = cloud == "aws" ? 120 : 30;
  EXPECT_NEAR(pn[0].at("notice_s").get<double>(), ahead, 2.0) << pn[0].dump();
  EXPECT_GT(pn[0].at("left_before_s").get<double>(), ahead - 10) << pn[0].dump();
  if (cloud != "gcp") {
    EXPECT_FALSE(pn[0].at("announced_time").get<std::string>().empty());
  }
  ASSERT_EQ(journal_events<ev::node_left>(j).size(), 1u);
  EXPECT_TRUE(journal_events<ev::node_lost>(j).empty()) << cl.logs();
  auto rec = journal_events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  EXPECT_EQ(rec[0].at("cause"), "node_left");
  EXPECT_EQ(rec[0].at("drain"), true);
  EXPECT_EQ(rec[0].at("lost_steps"), 0);
  // At the next step boundary the ranks agree on: the survivors' first step
  // at world 1 follows the notice within a second (steps here take ~5 ms,
  // so that is a handful of steps past the one b had reported).
  EXPECT_LT(rec[0].at("t").get<double>() - pn[0].at("t").get<double>(), 1.0) << rec[0].dump() << pn[0].dump();
  std::fprintf(stderr, "[ figure ] %s notice -> node gone in %.2f s, step %lld -> world 1 from step %lld, lost %lld\n", cloud.c_str(), gone_s,
               static_cast<long long>(pn[0].at("at_step").get<int64_t>()), static_cast<long long>(rec[0].at("resumed_step").get<int64_t>()),
               static_cast<long long>(rec[0].at("lost_steps").get<int64_t>()));
  // The documented handshake was used (AWS: a session token, then polls).
  const std::string stats = md.get("/__control/stats");
  if (cloud == "aws") {
    EXPECT_NE(stats.find("PUT /latest/api/token"), std::string::npos) << stats;
  }
}

}  // namespace

TEST(Preemption, AwsSpotInstanceAction) { preempt_with("aws"); }
TEST(Preemption, GcpPreempted) { preempt_with("gcp"); }
TEST(Preemption, AzureScheduledEventsPreempt) { preempt_with("azure"); }

TEST(Preemption, UnreachableMetadataServiceNeverStopsTraining) {
  temp_dir d;
  // A port nothing listens on; auto on the other node with every cloud there.
  const int dead = pick_free_tcp_port().value();
  const std::string url = "http://127.0.0.1:" + std::to_string(dead);
  ::setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", url.c_str(), 1);
  ::setenv("GCE_METADATA_HOST", ("127.0.0.1:" + std::to_string(dead)).c_str(), 1);
  cluster cl(d.path(), job_sets(60, {"cluster.min_nodes=2"}));
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a", {"--preemption-notice", "auto", "--azure-metadata-endpoint", url}), "");
  ASSERT_EQ(cl.start_node("b", {"--preemption-notice", "aws", "--preemption-poll-ms", "50"}), "");
  expect_finished_without_loss(cl, 60, 2);
  auto j = cl.journal();
  EXPECT_TRUE(journal_events<ev::node_left>(j).empty()) << cl.logs();
  EXPECT_TRUE(journal_events<ev::preemption_notice>(j).empty());
  EXPECT_NE(read_file(d.path() + "/node-a.log").find("not watching"), std::string::npos) << cl.logs();
  EXPECT_NE(read_file(d.path() + "/node-b.log").find("training goes on"), std::string::npos) << cl.logs();
}
