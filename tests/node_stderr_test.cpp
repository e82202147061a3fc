// A process whose stderr is a pipe nobody reads (a terminal in copy mode, a
// slow `| tee`, ssh) goes on: its log lines are dropped and counted
// (base/async_log.hpp), never waited for by an actor that heartbeats or a
// rank's training thread. A real coordinator and nodes on loopback; one
// process's output is a FIFO the test holds open and fills, and never reads.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <regex>
#include <string>

#include "chaos_checks.hpp"
#include "cluster_harness.hpp"
#include "http_get.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::cluster;
using testing::descendants;
using testing::events;
using testing::events_named;
using testing::job_sets;
using testing::temp_dir;
using json = nlohmann::json;

// A FIFO at `path` whose read end this holds open and never reads.
class unread_pipe {
 public:
  explicit unread_pipe(const std::string& path) {
    if (::mkfifo(path.c_str(), 0600) != 0) return;
    read_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    write_ = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  }
  ~unread_pipe() {
    if (write_ >= 0) ::close(write_);
    if (read_ >= 0) ::close(read_);
  }
  bool ok() const { return read_ >= 0 && write_ >= 0; }
  // Writes until the pipe is full: every further write to it blocks.
  void fill() {
    const std::string line(255, 'f');
    while (::write(write_, (line + "\n").data(), line.size() + 1) > 0) {
    }
  }

 private:
  int read_ = -1;
  int write_ = -1;
};

// Heartbeats the node's agent got answered (its /metrics), or -1.
int64_t heartbeats_acked(int metrics_port) {
  std::smatch m;
  const std::string scrape = test_support::http_get(metrics_port, "/metrics");
  static const std::regex re("\ndtactor_heartbeat_rtt_seconds_count(\\{[^}]*\\})? ([0-9.e+]+)");
  return std::regex_search(scrape, m, re) ? static_cast<int64_t>(std::stod(m[2])) : -1;
}

// The node that tester saw declared lost at a job's end, its lines blocked
// in a full pipe. Here its rank is killed once the pipe is full: the agent
// reports the exit, logs it and restarts the rank, and must go on
// heartbeating through all of it.
TEST(Chaos, NodeWhoseStderrIsNotReadIsNotDeclaredLost) {
  temp_dir d;
  // The job waits for a second node that never comes: membership only.
  cluster cl(d.path(), job_sets(100, {"cluster.min_nodes=2"}));
  unread_pipe pipe(d.path() + "/node-a.log");  // the node's stdout and stderr
  ASSERT_TRUE(pipe.ok());
  const int port = pick_free_tcp_port().value();
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a", {"--metrics-port", std::to_string(port)}), "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::node_joined>(j).empty(); })) << cl.logs();
  const pid_t node = cl.nodes.at("a").pid();
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>&) { return descendants(node).size() == 1 && heartbeats_acked(port) > 0; })) << cl.logs();

  pipe.fill();
  const pid_t rank = descendants(node)[0];
  ASSERT_EQ(::kill(rank, SIGKILL), 0);
  // The exit reached the coordinator (the agent logs it next), then 4 heartbeat
  // timeouts' worth of heartbeats were answered, or the node was lost.
  int64_t acked_after_exit = -1;
  const bool decided = cl.wait_for(
      [&](const std::vector<json>& j) {
        if (!events<ev::node_lost>(j).empty()) return true;
        if (events_named(j, ev::rank_down::exited_name).empty()) return false;
        const int64_t acked = heartbeats_acked(port);
        if (acked_after_exit < 0) acked_after_exit = acked;
        return acked >= acked_after_exit + 40;
      },
      60);
  const auto j = cl.journal();
  EXPECT_TRUE(decided) << "heartbeats acked since the rank's exit: " << heartbeats_acked(port) - acked_after_exit << "\n" << cl.logs();
  EXPECT_TRUE(events<ev::node_lost>(j).empty()) << "the node was declared lost while its stderr was full\n" << cl.logs();
  EXPECT_TRUE(cl.nodes.at("a").running());
}

// The job's end, within `timeout_s`: job_finished, or the coordinator's end.
bool finished(cluster& cl, int timeout_s) {
  return cl.wait_for([](const std::vector<json>& j) { return !events<ev::job_finished>(j).empty(); }, timeout_s);
}

// The coordinator's stdout and stderr are a full pipe before it starts: its
// first line (and every progress line after it) would block the thread that
// writes it, the actors that answer heartbeats among them. The job must
// train to its end, no node lost, and the coordinator exit on its own.
TEST(Chaos, CoordinatorWhoseStderrIsNotReadTrainsToTheEnd) {
  temp_dir d;
  cluster cl(d.path(), job_sets(30, {"cluster.min_nodes=2"}));
  unread_pipe pipe(d.path() + "/coordinator.log");
  ASSERT_TRUE(pipe.ok());
  pipe.fill();
  ASSERT_EQ(cl.start({"a", "b"}), "");
  EXPECT_TRUE(finished(cl, 90)) << "the job did not finish while the coordinator's stderr was full\n" << cl.logs();
  const auto j = cl.journal();
  const auto fin = events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u) << cl.logs();
  EXPECT_EQ(fin[0].at("step"), 30);
  EXPECT_TRUE(events<ev::node_lost>(j).empty()) << cl.logs();
  // Its last lines (the result on stdout) wait at most 2 s for the pipe.
  const auto done = cl.coord->wait(30000);
  ASSERT_TRUE(done) << "the coordinator did not exit\n" << cl.logs();
  EXPECT_EQ(done->exit_code, 0) << done->describe();
}

// Node a's output, which its ranks share, is a full pipe before it starts:
// each rank's lines (the transport it chose at every generation of world 2,
// anything LibTorch or Gloo says) would block its training thread. The
// node reads its ranks' output itself: steps keep coming to the end.
TEST(Chaos, RanksWhoseStderrIsNotReadKeepTraining) {
  temp_dir d;
  cluster cl(d.path(), job_sets(30, {"cluster.min_nodes=2"}));
  unread_pipe pipe(d.path() + "/node-a.log");
  ASSERT_TRUE(pipe.ok());
  pipe.fill();
  ASSERT_EQ(cl.start({"a", "b"}), "");
  EXPECT_TRUE(finished(cl, 90)) << "the job did not finish while node a's stderr was full\n" << cl.logs();
  const auto j = cl.journal();
  const auto fin = events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u) << "steps journaled: " << events<ev::step_completed>(j).size() << "\n" << cl.logs();
  EXPECT_EQ(fin[0].at("step"), 30);
  EXPECT_EQ(fin[0].at("world_size"), 2);
  EXPECT_TRUE(events<ev::node_lost>(j).empty()) << cl.logs();
}

}  // namespace
}  // namespace dtactor
