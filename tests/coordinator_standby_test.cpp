// A standby coordinator (--lease, --standby; app/coordinator_lease.hpp):
// real coordinators and nodes on loopback sharing a lease in a directory.
// The standby waits while the first holds the lease, takes it over when
// the first is killed, and runs the job to its end from the same address
// and run directory (as a floating address or a Service would give it); a
// coordinator that finds a newer epoch stops deciding; a leader cut off and
// healed stops deciding on its own, unless nobody took the lease meanwhile
// (then it takes it back); a second one without --standby is refused in
// one line.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "chaos_checks.hpp"
#include "cluster_harness.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::cluster;
using testing::job_sets;
using testing::journal_events;
using testing::json;
using testing::temp_dir;

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Until `path` holds `text`, or `p` ended, or 60 s.
bool wait_for_text(const std::string& path, const std::string& text, child_process& p) {
  for (int i = 0; i < 3000; ++i) {
    if (read_text(path).find(text) != std::string::npos) return true;
    if (!p.running()) return read_text(path).find(text) != std::string::npos;
    p.wait(20);
  }
  return false;
}

// A free port below the kernel's ephemeral range (32768 and up here), for
// a coordinator that binds it seconds later: the ranks' connections and
// Gloo's listeners, which take ephemeral ports meanwhile, cannot take it.
int port_outside_the_ephemeral_range() {
  for (int port = 20000 + static_cast<int>(::getpid() % 5000);; port = port >= 32000 ? 20000 : port + 7) {
    const int s = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(s);
    if (free) return port;
  }
}

std::vector<std::string> coordinator_args(const cluster& cl, const std::vector<std::string>& extra) {
  std::vector<std::string> a = {DTACTOR_BINARY, "--role", "coordinator", "--listen", cl.endpoint, "--run-dir", cl.run_dir};
  a.insert(a.end(), cl.sets.begin(), cl.sets.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// A leased leader on cl.endpoint, nodes a and b given its address and the
// standby's (--coordinator A,B), and the standby on an address of its own.
struct standby_pair {
  std::string address;  // the standby's --listen
  std::string log;
  std::optional<child_process> standby;

  // "" once the leader trained 30 steps and the standby stands by, else
  // what went wrong.
  std::string start(cluster& cl, const std::vector<std::string>& leased) {
    if (auto e = cl.start_coordinator(leased); !e.empty()) return e;
    address = "tcp://127.0.0.1:" + std::to_string(port_outside_the_ephemeral_range());
    cl.endpoint += "," + address;  // what the nodes are given
    for (const char* node : {"a", "b"})
      if (auto e = cl.start_node(node); !e.empty()) return e;
    if (!cl.wait_step(30)) return "no step 30 under the leader\n" + cl.logs();
    auto args = coordinator_args(cl, leased);
    args[4] = address;  // --listen
    args.push_back("--standby");
    log = cl.run_dir + "/standby.log";
    auto spawned = child_process::spawn(args, false, log);
    if (!spawned) return spawned.message();
    standby.emplace(std::move(spawned.value()));
    if (!wait_for_text(log, "standing by: the job's lease is held by", *standby)) return "the standby did not stand by\n" + read_text(log);
    return "";
  }
};

TEST(Standby, AStandbyTakesOverWhenTheCoordinatorIsKilledAndTheJobFinishesWithoutLoss) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "1000"};
  cluster cl(d.path(), job_sets(1500, {"cluster.min_nodes=2"}));
  ASSERT_EQ(cl.start_coordinator(leased), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_EQ(cl.start_node("b"), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  // The standby: same address and run directory, waiting for the lease.
  auto standby_args = coordinator_args(cl, leased);
  standby_args.push_back("--standby");
  const std::string standby_log = cl.run_dir + "/standby.log";
  auto standby = child_process::spawn(standby_args, false, standby_log);
  ASSERT_TRUE(standby) << standby.message();
  ASSERT_TRUE(wait_for_text(standby_log, "standing by: the job's lease is held by", *standby)) << read_text(standby_log);
  ASSERT_TRUE(cl.wait_step(60)) << cl.logs();
  EXPECT_TRUE(standby->running()) << "the standby must wait while the coordinator renews: " << read_text(standby_log);
  cl.coord->signal(SIGKILL);
  ASSERT_TRUE(cl.coord->wait(10000));
  ASSERT_TRUE(wait_for_text(standby_log, "holds the job's lease at " + lease.path() + ", epoch 2", *standby)) << read_text(standby_log);
  // The standby is the coordinator now: it adopts the running generation
  // and ends the job.
  cl.coord.emplace(std::move(standby.value()));
  testing::expect_finished_without_loss(cl, 1500, 2);
}

// Nodes given both coordinators' addresses (--coordinator A,B) move to the
// standby on its own address once it holds the lease.
TEST(Standby, NodesGivenBothAddressesMoveToTheStandbyOnItsOwnAddress) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "1000", "--advertise-addr", "127.0.0.1"};
  cluster cl(d.path(), job_sets(1500, {"cluster.min_nodes=2"}));
  standby_pair pair;
  ASSERT_EQ(pair.start(cl, leased), "");
  cl.coord->signal(SIGKILL);
  ASSERT_TRUE(cl.coord->wait(10000));
  ASSERT_TRUE(wait_for_text(pair.log, "listening on " + pair.address, *pair.standby)) << read_text(pair.log);
  cl.coord.emplace(std::move(pair.standby.value()));
  testing::expect_finished_without_loss(cl, 1500, 2);
}

TEST(Standby, ACoordinatorThatFindsANewerEpochStopsDecidingAndASecondOneIsRefused) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "1000"};
  cluster cl(d.path(), job_sets(100000, {"cluster.min_nodes=1"}));
  ASSERT_EQ(cl.start_coordinator(leased), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_TRUE(cl.wait_step(10)) << cl.logs();
  // Without --standby, a second coordinator of the job is refused.
  temp_dir other;
  auto second_args = coordinator_args(cl, leased);
  second_args[6] = other.path();  // --run-dir
  auto second = child_process::spawn(second_args, false, other.path() + "/second.log");
  ASSERT_TRUE(second);
  auto second_done = second->wait(30000);
  ASSERT_TRUE(second_done);
  EXPECT_EQ(second_done->exit_code, 2);
  const std::string refused = read_text(other.path() + "/second.log");
  EXPECT_NE(refused.find("another coordinator runs this job; add --standby"), std::string::npos) << refused;
  // A standby elsewhere took epoch 2 (its view: this one went silent).
  { std::ofstream(lease.path() + "/epoch-2") << R"({"holder":"elsewhere","address":"tcp://198.18.0.9:29400"})"; }
  auto done = cl.coord->wait(10000);
  ASSERT_TRUE(done) << "the deposed coordinator went on deciding\n" << cl.logs();
  EXPECT_EQ(done->exit_code, 3);
  EXPECT_NE(read_text(cl.run_dir + "/coordinator.log").find("stops deciding: another coordinator took the job's lease"), std::string::npos)
      << cl.logs();
}

// A leader cut off (stopped: as silent as a partition makes it) is replaced
// by the standby, though it still holds the run directory's lock. Let go
// (the heal), it stops deciding (exit 3) before it journals anything of
// what queued up while it was stopped, and the job ends under the standby
// without a step lost or journaled twice.
TEST(Standby, ACutOffLeaderIsReplacedAndWhenHealedStopsDecidingWithNothingLost) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "1000", "--advertise-addr", "127.0.0.1"};
  cluster cl(d.path(), job_sets(1500, {"cluster.min_nodes=2"}));
  standby_pair pair;
  ASSERT_EQ(pair.start(cl, leased), "");
  auto& standby = pair.standby;
  const std::string& standby_log = pair.log;
  cl.coord->signal(SIGSTOP);
  ASSERT_TRUE(wait_for_text(standby_log, "listening on " + pair.address, *standby)) << read_text(standby_log);
  EXPECT_NE(read_text(standby_log).find("still held by"), std::string::npos) << read_text(standby_log);
  child_process old = std::move(*cl.coord);
  cl.coord.emplace(std::move(standby.value()));
  old.signal(SIGCONT);
  auto done = old.wait(30000);
  ASSERT_TRUE(done) << "the healed leader went on deciding\n" << read_text(cl.run_dir + "/coordinator.log");
  EXPECT_EQ(done->exit_code, 3) << read_text(cl.run_dir + "/coordinator.log");
  EXPECT_NE(read_text(cl.run_dir + "/coordinator.log").find("stops deciding"), std::string::npos) << read_text(cl.run_dir + "/coordinator.log");
  testing::expect_finished_without_loss(cl, 1500, 2);
}

// The leader's machine is lost without a FIN (stopped here: its
// connections stay open and say nothing). Each node registers with the
// standby the moment its connection to the standby's address comes up, not
// after its heartbeat timeout (6 s here), though it dialled that address in
// vain for seconds (a single link's backoff would be at its 5 s maximum by
// then): the standby leads the running generation well within 1.5 s of
// listening. Healed, the old leader stops deciding; nothing is lost.
TEST(Standby, TheNodesRegisterWithTheStandbyAsSoonAsItListens) {
  temp_dir d, lease;
  // A TTL a loaded machine's scheduling cannot outlast (a leader that
  // misses its renewal steps down, as it must; not what is tested here).
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "2500", "--advertise-addr", "127.0.0.1"};
  const int64_t max_steps = 8000;
  cluster cl(d.path(), job_sets(static_cast<int>(max_steps), {"cluster.min_nodes=2", "cluster.heartbeat_timeout_ms=6000"}));
  standby_pair pair;
  ASSERT_EQ(pair.start(cl, leased), "");
  std::this_thread::sleep_for(std::chrono::seconds(5));  // the input: how long the standby stood by
  cl.coord->signal(SIGSTOP);
  json started, adopted;
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) {
    const auto s = journal_events<ev::coordinator_started>(j);
    const auto a = journal_events<ev::generation_adopted>(j);
    if (s.size() < 2 || a.empty()) return false;
    started = s.back();
    adopted = a.back();
    return true;
  })) << "the standby did not adopt the running generation\n" << read_text(pair.log) << cl.logs();
  const double after_s = adopted.at("t").get<double>() - started.at("t").get<double>();
  EXPECT_LT(after_s, 1.5) << "the standby led " << after_s << " s after it listened\n" << read_text(pair.log);
  child_process old = std::move(*cl.coord);
  cl.coord.emplace(std::move(pair.standby.value()));
  old.signal(SIGCONT);
  auto done = old.wait(30000);
  ASSERT_TRUE(done) << "the healed leader went on deciding\n" << read_text(cl.run_dir + "/coordinator.log");
  EXPECT_EQ(done->exit_code, 3) << read_text(cl.run_dir + "/coordinator.log");
  testing::expect_finished_without_loss(cl, max_steps, 2);
}

// Both coordinators started in the same moment, both --standby, each on
// its own address: exactly one takes the free lease (epoch 1) and leads,
// the other stands by. Nodes given both addresses train under the leader;
// killed, it is replaced by the other (epoch 2) and the job ends without
// loss.
TEST(Standby, TwoCoordinatorsStartedAtOnceOneLeadsTheOtherStandsByAndTakesOver) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "1000", "--advertise-addr", "127.0.0.1", "--standby"};
  cluster cl(d.path(), job_sets(1500, {"cluster.min_nodes=2"}));
  const std::string second = "tcp://127.0.0.1:" + std::to_string(port_outside_the_ephemeral_range());
  std::vector<child_process> coords;
  std::vector<std::string> logs;
  for (const std::string& address : {cl.endpoint, second}) {
    auto args = coordinator_args(cl, leased);
    args[4] = address;  // --listen
    logs.push_back(cl.run_dir + "/coordinator-" + std::to_string(coords.size()) + ".log");
    auto c = child_process::spawn(args, false, logs.back());
    ASSERT_TRUE(c) << c.message();
    coords.push_back(std::move(c.value()));
  }
  // Each either leads or stands by; not both lead.
  auto said = [&](size_t i, const std::string& text) { return read_text(logs[i]).find(text) != std::string::npos; };
  auto settled = [&](size_t i) { return said(i, "holds the job's lease") || said(i, "standing by"); };
  for (int i = 0; i < 3000 && !(settled(0) && settled(1)); ++i)
    coords[0].wait(20);
  const size_t leader = said(0, "holds the job's lease") ? 0 : 1, standby = 1 - leader;
  ASSERT_TRUE(said(leader, "holds the job's lease at " + lease.path() + ", epoch 1")) << read_text(logs[0]) << read_text(logs[1]);
  EXPECT_TRUE(said(standby, "standing by: the job's lease is held by")) << read_text(logs[standby]);
  EXPECT_FALSE(said(standby, "holds the job's lease")) << read_text(logs[standby]);
  cl.endpoint += "," + second;  // what the nodes are given
  for (const char* node : {"a", "b"}) ASSERT_EQ(cl.start_node(node), "");
  cl.coord.emplace(std::move(coords[leader]));
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  EXPECT_TRUE(coords[standby].running()) << read_text(logs[standby]);
  cl.coord->signal(SIGKILL);
  ASSERT_TRUE(cl.coord->wait(10000));
  ASSERT_TRUE(wait_for_text(logs[standby], "holds the job's lease at " + lease.path() + ", epoch 2", coords[standby])) << read_text(logs[standby]);
  cl.coord.emplace(std::move(coords[standby]));
  testing::expect_finished_without_loss(cl, 1500, 2);
}

// A node given the coordinators' addresses starts while the first one's
// host name no longer resolves (its machine gone, its name with it): it
// takes the next one that resolves, joins and trains.
TEST(Standby, ANodeWhoseFirstCoordinatorNameDoesNotResolveJoinsThroughTheNext) {
  temp_dir d;
  cluster cl(d.path(), job_sets(40, {"cluster.min_nodes=1"}));
  ASSERT_EQ(cl.start_coordinator(), "");
  cl.endpoint = "tcp://no-such-host.invalid:29400," + cl.endpoint;
  ASSERT_EQ(cl.start_node("a"), "");
  testing::expect_finished_without_loss(cl, 40, 1);
}

// A leader whose renewal comes late, past half the TTL but within it (a
// loaded machine: here stopped for 0.6 of the TTL), still holds the
// lease: a standby leads only after a TTL without a renewal. It goes on
// leading, its decisions held back only until it has renewed, and the
// standby keeps standing by.
TEST(Standby, ALeaderLateToRenewWithinTheTTLGoesOnLeading) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "3000", "--advertise-addr", "127.0.0.1"};
  // Nodes wait out the stopped coordinator's silence (not the subject here).
  cluster cl(d.path(), job_sets(1500, {"cluster.min_nodes=2", "cluster.heartbeat_timeout_ms=6000"}));
  standby_pair pair;
  ASSERT_EQ(pair.start(cl, leased), "");
  cl.coord->signal(SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(1800));  // the delay is the input
  cl.coord->signal(SIGCONT);
  testing::expect_finished_without_loss(cl, 1500, 2);
  EXPECT_EQ(read_text(cl.run_dir + "/coordinator.log").find("stops deciding"), std::string::npos) << read_text(cl.run_dir + "/coordinator.log");
  EXPECT_TRUE(pair.standby->running()) << read_text(pair.log);
  EXPECT_EQ(read_text(pair.log).find("listening on"), std::string::npos) << read_text(pair.log);
}

// A leader with no standby stopped past its lease's TTL (a stalled
// machine): when it runs again nobody took the lease meanwhile, so it
// takes it back under the next epoch and goes on deciding; the nodes
// follow the newer epoch and the job ends without loss.
TEST(Standby, ALeaderAloneStoppedPastItsTTLTakesTheLeaseBackAndGoesOn) {
  temp_dir d, lease;
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "1000"};
  cluster cl(d.path(), job_sets(1500, {"cluster.min_nodes=2", "cluster.heartbeat_timeout_ms=6000"}));
  ASSERT_EQ(cl.start_coordinator(leased), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_EQ(cl.start_node("b"), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  cl.coord->signal(SIGSTOP);
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));  // the stall is the input: 2.5 TTLs
  cl.coord->signal(SIGCONT);
  ASSERT_TRUE(wait_for_text(cl.run_dir + "/coordinator.log", "holds it again at " + lease.path() + ", epoch 2", *cl.coord)) << cl.logs();
  testing::expect_finished_without_loss(cl, 1500, 2);
  EXPECT_EQ(read_text(cl.run_dir + "/coordinator.log").find("stops deciding"), std::string::npos) << cl.logs();
}

// The standby leads for a while beside a leader stopped with its
// connections open: the nodes speak to the standby alone (the newest epoch
// they heard), so it journals every step, not the share of them whose
// reports did not go to the stopped one. Healed, the old leader stops
// deciding and the job ends without loss.
TEST(Standby, WhileTheStoppedLeaderKeepsItsConnectionsTheNodesSpeakToTheStandbyAlone) {
  temp_dir d, lease;
  // A TTL a loaded machine's scheduling cannot outlast (a leader that
  // misses its renewal steps down, as it must; not what is tested here).
  const std::vector<std::string> leased = {"--lease", lease.path(), "--lease-ttl-ms", "2500", "--advertise-addr", "127.0.0.1"};
  const int64_t max_steps = 8000;
  cluster cl(d.path(), job_sets(static_cast<int>(max_steps), {"cluster.min_nodes=2"}));
  standby_pair pair;
  ASSERT_EQ(pair.start(cl, leased), "");
  auto& standby = pair.standby;
  const std::string& standby_log = pair.log;
  cl.coord->signal(SIGSTOP);
  ASSERT_TRUE(wait_for_text(standby_log, "listening on " + pair.address, *standby)) << read_text(standby_log);
  child_process old = std::move(*cl.coord);
  cl.coord.emplace(std::move(standby.value()));
  // The old leader journals nothing while stopped. From 50 steps after the
  // standby's first journaled step, a window of 200 steps (ranks report
  // every step): each must have its line.
  const auto before = journal_events<ev::step_completed>(cl.journal());
  const int64_t old_last = before.empty() ? 0 : before.back().at("step").get<int64_t>();
  int64_t from = -1;
  ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) {
    const auto steps = journal_events<ev::step_completed>(j);
    if (steps.empty() || steps.back().at("step").get<int64_t>() <= old_last) return false;
    if (from < 0)
      for (const auto& e : steps)
        if (from < 0 && e.at("step").get<int64_t>() > old_last) from = e.at("step").get<int64_t>() + 50;
    return steps.back().at("step").get<int64_t>() >= from + 200;
  })) << "the standby journaled no steps past " << from + 200 << "\n" << cl.logs();
  std::set<int64_t> journaled;
  for (const auto& e : journal_events<ev::step_completed>(cl.journal()))
    if (const auto s = e.at("step").get<int64_t>(); s > from && s <= from + 200) journaled.insert(s);
  EXPECT_GE(journaled.size(), 190u) << "steps " << from + 1 << "-" << from + 200 << " under the standby: most reports went to the stopped leader\n"
                                    << cl.logs();
  old.signal(SIGCONT);
  auto done = old.wait(30000);
  ASSERT_TRUE(done) << "the healed leader went on deciding\n" << read_text(cl.run_dir + "/coordinator.log");
  EXPECT_EQ(done->exit_code, 3) << read_text(cl.run_dir + "/coordinator.log");
  testing::expect_finished_without_loss(cl, max_steps, 2);
}

}  // namespace
}  // namespace dtactor
