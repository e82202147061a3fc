// Fault handling end to end: a real coordinator and real node processes (with
// their rank processes) on loopback, and real failures: kill -9 of a rank or
// a node, SIGSTOP (the silent case), SIGTERM (a preemption notice), a node
// joining mid-run, the coordinator killed and restarted, every node lost, a
// truncated checkpoint, a flapping node. Each test waits for journal events,
// never for fixed times, and checks that training finishes, that no
// completed step was lost and that every rank ended with the same parameters.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "chaos_prelude.hpp"
#include "cluster_harness.hpp"
#include "storage/checkpoint_store.hpp"
#include "base/process.hpp"
#include "net/zmq_bridge.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using namespace chaos;

TEST(Chaos, KillOfARankProcessIsRecoveredWithoutRestartingOthers) {
  temp_dir d;
  // The survivor waits for the restarted rank (floor 2) rather than finish alone.
  cluster cl(d.path(), job_sets(300, {"cluster.min_nodes=2", "cluster.floor_nodes=2"}));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  // Rank processes, not warm spares (DTACTOR_TEST_SPARES).
  auto ranks_a = testing::rank_processes(cl.nodes.at("a").pid());
  auto ranks_b = testing::rank_processes(cl.nodes.at("b").pid());
  ASSERT_EQ(ranks_b.size(), 1u);
  ASSERT_EQ(::kill(ranks_b[0], SIGKILL), 0);
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) {
    for (const auto& r : events<ev::recovery_done>(j))
      if (r.at("world_size") == 2) return true;
    return false;
  })) << cl.logs();
  // The survivor's rank process was not restarted.
  EXPECT_EQ(testing::rank_processes(cl.nodes.at("a").pid()), ranks_a);
  expect_finished_without_loss(cl, 300, 2);
  auto j = cl.journal();
  EXPECT_GE(events_named(j, ev::rank_down::exited_name).size(), 1u);
  EXPECT_GE(events<ev::checkpoint_restored>(j).size(), 1u);  // the new rank process got the state from a peer
  for (const auto& r : events<ev::checkpoint_restored>(j)) EXPECT_EQ(r.at("source"), "peer");
}

// The job waited for both nodes (cluster.min_nodes=2, the start gate) and
// goes on alone when one is lost (the floor, cluster.floor_nodes, is 1).
TEST(Chaos, KillOfANodeShrinksTheJob) {
  temp_dir d;
  cluster cl(d.path(), job_sets(300, {"cluster.min_nodes=2"}));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30, 2)) << cl.logs();
  auto survivor = descendants(cl.nodes.at("a").pid());
  cl.signal_node("b", SIGKILL);
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::recovery_done>(j).empty(); })) << cl.logs();
  EXPECT_EQ(descendants(cl.nodes.at("a").pid()), survivor);  // no survivor restarted
  expect_finished_without_loss(cl, 300, 1);
  auto j = cl.journal();
  auto lost = events<ev::node_lost>(j);
  ASSERT_EQ(lost.size(), 1u) << cl.logs();
  EXPECT_EQ(lost[0].at("node"), "b");
  auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  EXPECT_EQ(rec[0].at("world_size"), 1);
  EXPECT_EQ(rec[0].at("cause"), "node_lost");
}

// `base` and then `more` (a variant of a test: train.sync = diloco).
std::vector<std::string> with(const std::vector<std::string>& more, std::vector<std::string> base) {
  base.insert(base.end(), more.begin(), more.end());
  return base;
}

void silent_node_is_declared_lost(const std::string& zero, const std::vector<std::string>& more = {}) {
  temp_dir d;
  // Both nodes from the start (gate 2, floor 1): on a loaded machine one can
  // be late, and its join would be the first recovery this test waits for.
  cluster cl(d.path(), job_sets(300, with(more, {"cluster.min_nodes=2", "train.zero=" + zero})));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30, 2)) << cl.logs();
  const auto t0 = std::chrono::steady_clock::now();
  cl.signal_node("b", SIGSTOP);
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::recovery_done>(j).empty(); })) << cl.logs();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Far below Gloo's collective timeout (30 s): the blocked allreduce was abandoned.
  EXPECT_LT(took, 10.0);
  expect_finished_without_loss(cl, 300, 1);
  auto lost = events<ev::node_lost>(cl.journal());
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].at("node"), "b");
  EXPECT_LT(lost[0].at("detected_after_s").get<double>(), 3.0);
}

TEST(Chaos, SilentNodeIsDeclaredLostAndItsCollectiveAbandoned) { silent_node_is_declared_lost("0"); }

// The same with the optimizer state and gradients sharded (train.zero=2).
TEST(Chaos, SilentNodeIsDeclaredLostAndItsCollectiveAbandonedWithShardedState) { silent_node_is_declared_lost("2"); }

// And with the parameters sharded too (train.zero=3).
TEST(Chaos, SilentNodeIsDeclaredLostAndItsCollectiveAbandonedWithShardedParameters) { silent_node_is_declared_lost("3"); }

void preemption_notice_drains_without_rollback(const std::string& zero, const std::vector<std::string>& more = {}) {
  temp_dir d;
  // Both nodes from the start (gate 2, floor 1): a late node's join would be
  // the first recovery (found under ctest -j2).
  cluster cl(d.path(), job_sets(300, with(more, {"cluster.min_nodes=2", "train.zero=" + zero})));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30, 2)) << cl.logs();
  cl.nodes.at("b").signal(SIGTERM);
  auto e = cl.nodes.at("b").wait(30000);
  ASSERT_TRUE(e) << "the leaving node did not end\n" << cl.logs();
  EXPECT_EQ(e->exit_code, 128 + SIGTERM) << e->describe();
  expect_finished_without_loss(cl, 300, 1);
  auto j = cl.journal();
  ASSERT_EQ(events<ev::node_left>(j).size(), 1u) << cl.logs();
  EXPECT_TRUE(events<ev::node_lost>(j).empty());
  EXPECT_TRUE(events_named(j, ev::rank_down::failed_name).empty()) << cl.logs();
  auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  EXPECT_EQ(rec[0].at("cause"), "node_left");
  EXPECT_EQ(rec[0].at("drain"), true);
}

TEST(Chaos, PreemptionNoticeDrainsWithoutRollback) { preemption_notice_drains_without_rollback("0"); }

// The same with the optimizer state and gradients sharded (train.zero=2).
TEST(Chaos, PreemptionNoticeDrainsWithoutRollbackWithShardedState) { preemption_notice_drains_without_rollback("2"); }

// And with the parameters sharded too (train.zero=3).
TEST(Chaos, PreemptionNoticeDrainsWithoutRollbackWithShardedParameters) { preemption_notice_drains_without_rollback("3"); }

void node_joining_mid_run_gets_state_from_a_peer(const std::string& zero) {
  temp_dir d;
  // A job that outlasts the join whatever the machine's speed (1,500 steps
  // once ended before a slow rank start had joined): the test waits for the
  // join itself, trains on at world 2, then stops the job.
  cluster cl(d.path(), job_sets(1000000, {"cluster.min_nodes=1", "checkpoint.every_steps=1000000", "train.zero=" + zero}));
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  ASSERT_EQ(cl.start_node("b"), "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) {
    for (const auto& r : events<ev::recovery_done>(j))
      if (r.at("world_size") == 2) return true;
    return false;
  })) << cl.logs();
  const int64_t joined_at = events<ev::recovery_done>(cl.journal()).back().at("resumed_step").get<int64_t>();
  ASSERT_TRUE(cl.wait_step(joined_at + 50, 2)) << cl.logs();
  cl.coord->signal(SIGTERM);
  auto done = cl.coord->wait(60000);
  ASSERT_TRUE(done) << cl.logs();
  EXPECT_EQ(done->exit_code, 128 + SIGTERM) << done->describe();
  auto j = cl.journal();
  auto stopped = events<ev::job_stopped>(j);
  ASSERT_EQ(stopped.size(), 1u) << cl.logs();
  EXPECT_FALSE(stopped[0].contains("error")) << stopped[0].dump();  // both ranks stopped with the same parameters
  EXPECT_EQ(stopped[0].at("world_size"), 2);
  auto restored = events<ev::checkpoint_restored>(j);
  ASSERT_GE(restored.size(), 1u) << cl.logs();
  EXPECT_EQ(restored[0].at("source"), "peer");
  EXPECT_GE(restored[0].at("step").get<int64_t>(), 30);
  // By default a joining rank heals while its peer trains (train.zero = 0,
  // 1 and 2, the moments resharded on the same thread; at zero = 3 the
  // sharded parameters move before the first step).
  EXPECT_EQ(restored[0].value("while_training", false), zero != "3") << restored[0].dump();
  auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  EXPECT_EQ(rec.back().at("world_size"), 2);
  EXPECT_EQ(rec.back().at("drain"), true);
  for (const auto& r : rec) EXPECT_EQ(r.at("lost_steps"), 0) << r.dump();
}

TEST(Chaos, NodeJoiningMidRunGetsStateFromAPeer) { node_joining_mid_run_gets_state_from_a_peer("0"); }

// The same with the optimizer state and gradients sharded (train.zero=2).
TEST(Chaos, NodeJoiningMidRunGetsStateFromAPeerWithShardedState) { node_joining_mid_run_gets_state_from_a_peer("2"); }

// And with the parameters sharded too (train.zero=3).
TEST(Chaos, NodeJoiningMidRunGetsStateFromAPeerWithShardedParameters) { node_joining_mid_run_gets_state_from_a_peer("3"); }

// A node that joined mid-run ends the job with the others, on a machine
// loaded past its cores (a busy loop beside the job): c killed, d joined,
// then the final checkpoint, the final evaluation and the end. This once
// flapped: the coordinator, stalled, declared healthy nodes lost (all of them
// at once, or the newcomer again and again at the end), and the final step
// was checkpointed twice. Only c is lost, the final step is checkpointed
// once, and the job ends at world 3.
TEST(Chaos, ANodeThatJoinedMidRunEndsTheJobWithTheOthersOnALoadedMachine) {
  temp_dir d;
  auto busy = child_process::spawn({"/bin/sh", "-c", "while :; do :; done"});
  ASSERT_TRUE(busy) << busy.message();
  // Long enough for d's join on a slow machine (its rank's start takes
  // seconds); checkpoints every 500 steps.
  constexpr int64_t steps = 3000;
  cluster cl(d.path(), job_sets(steps, {"cluster.min_nodes=3", "train.zero=2", "checkpoint.every_steps=500", "eval.max_samples=2000"}));
  ASSERT_EQ(cl.start({"a", "b", "c"}), "");
  ASSERT_TRUE(cl.wait_step(60, 3)) << cl.logs();
  cl.signal_node("c", SIGKILL);
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::recovery_done>(j).empty(); })) << cl.logs();
  ASSERT_TRUE(cl.wait_step(100, 2)) << cl.logs();
  ASSERT_EQ(cl.start_node("d"), "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) {
    for (const auto& r : events<ev::recovery_done>(j))
      if (r.at("world_size") == 3) return true;
    return false;
  })) << cl.logs();
  expect_finished_without_loss(cl, steps, 3);
  busy.value().signal(SIGKILL);
  auto j = cl.journal();
  auto lost = events<ev::node_lost>(j);
  ASSERT_EQ(lost.size(), 1u) << cl.logs();
  EXPECT_EQ(lost[0].at("node"), "c");
  int final_saves = 0;
  for (const auto& e : events<ev::checkpoint_saved>(j)) final_saves += e.at("step") == steps ? 1 : 0;
  EXPECT_EQ(final_saves, 1) << "the final step was checkpointed " << final_saves << " times";
  EXPECT_EQ(events<ev::generation_started>(j).size(), 3u) << "start, c lost, d joined; no generation more";
}

TEST(Chaos, EveryNodeLostThenNewNodesResumeFromDisk) {
  temp_dir d;
  cluster cl(d.path(), job_sets(200, {"cluster.min_nodes=2"}));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) {
    auto c = events<ev::checkpoint_saved>(j);
    return !c.empty() && c.back().at("step").get<int64_t>() >= 40;
  })) << cl.logs();
  cl.signal_node("a", SIGKILL);
  cl.signal_node("b", SIGKILL);
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return events<ev::node_lost>(j).size() >= 2; })) << cl.logs();
  ASSERT_EQ(cl.start_node("c"), "");
  ASSERT_EQ(cl.start_node("d"), "");
  auto done = cl.coord->wait(150000);
  ASSERT_TRUE(done) << cl.logs();
  EXPECT_EQ(done->exit_code, 0) << cl.logs();
  auto j = cl.journal();
  // The new nodes resume from disk: from the newest checkpoint committed
  // before they came, or from one a's and b's last parts committed just
  // after (the parts of the dead may be committed after their loss is
  // journaled); either way, from one committed before the restore.
  int64_t saved = -1;
  std::set<int64_t> committed;
  std::optional<int64_t> restored;
  bool new_nodes = false;
  std::string story;
  for (const auto& e : j) {
    const auto ev = e.value("event", "");
    if (ev == "node_joined" || ev == "node_lost" || ev == "checkpoint_saved" || ev == "checkpoint_restored" || ev == "generation_started")
      story += e.dump() + "\n";
    if (ev == "node_joined" && (e.value("node", "") == "c" || e.value("node", "") == "d")) new_nodes = true;
    if (ev == "checkpoint_saved") {
      committed.insert(e.at("step").get<int64_t>());
      if (!new_nodes) saved = e.at("step").get<int64_t>();
    }
    if (ev == "checkpoint_restored" && !restored && e.at("source") == "disk" && committed.count(e.at("step").get<int64_t>()))
      restored = e.at("step").get<int64_t>();
  }
  ASSERT_GE(saved, 40) << cl.logs();
  ASSERT_TRUE(restored) << "no resume from a committed checkpoint; the journal:\n" << story << cl.logs();
  EXPECT_GE(*restored, saved) << story;
  auto fin = events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].at("step"), 200);
  EXPECT_FALSE(fin[0].contains("error"));
}

TEST(Chaos, TruncatedNewestCheckpointIsSkipped) {
  temp_dir d;
  {
    cluster cl(d.path(), job_sets(100000, {"cluster.min_nodes=2"}));
    ASSERT_EQ(cl.start({"a", "b"}), "");
    ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return events<ev::checkpoint_saved>(j).size() >= 3; })) << cl.logs();
    // Everything vanishes at once (the destructor kills -9).
  }
  auto saved = events<ev::checkpoint_saved>(read_journal(d.path() + "/journal.jsonl"));
  ASSERT_GE(saved.size(), 3u);
  // The newest file that is still on disk (rotation keeps the last few).
  std::string newest;
  int64_t newest_step = -1;
  for (const auto& s : saved)
    if (std::filesystem::exists(s.at("path").get<std::string>()) && s.at("step").get<int64_t>() > newest_step) {
      newest = s.at("path").get<std::string>();
      newest_step = s.at("step").get<int64_t>();
    }
  ASSERT_FALSE(newest.empty());
  // Cut one of its parts short (a rank's write that a crash interrupted).
  char prefix[32];
  std::snprintf(prefix, sizeof prefix, "ckpt-%09lld.g", static_cast<long long>(newest_step));
  std::string part;
  for (const auto& e : std::filesystem::directory_iterator(std::filesystem::path(newest).parent_path()))
    if (e.path().filename().string().rfind(prefix, 0) == 0) part = e.path().string();
  ASSERT_FALSE(part.empty());
  std::filesystem::resize_file(part, std::filesystem::file_size(part) / 2);
  cluster cl(d.path(), job_sets(static_cast<int>(newest_step) + 40, {"cluster.min_nodes=2"}));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  auto done = cl.coord->wait(150000);
  ASSERT_TRUE(done) << cl.logs();
  EXPECT_EQ(done->exit_code, 0) << cl.logs();
  auto j = cl.journal();
  bool skipped = false;
  for (const auto& s : events<ev::checkpoint_skipped>(j))
    if (s.at("path") == newest) skipped = true;
  EXPECT_TRUE(skipped) << cl.logs();
  auto restored = events<ev::checkpoint_restored>(j);
  ASSERT_FALSE(restored.empty());
  EXPECT_EQ(restored.back().at("source"), "disk");
  EXPECT_LT(restored.back().at("step").get<int64_t>(), newest_step);
  auto fin = events<ev::job_finished>(j);
  ASSERT_FALSE(fin.empty());
  EXPECT_EQ(fin.back().at("step"), newest_step + 40);
}

// BatchNorm's running statistics change in training: every rank takes rank
// 0's after each step (as DDP does), so the ranks never drift apart (the
// digest comparison every 5 steps would stop the job), also across a
// generation change (a node killed: the survivors go on).
TEST(Chaos, BatchNormBuffersStayEqualAcrossRanks) {
  temp_dir fix;
  const std::string src = DTACTOR_SOURCE_DIR;
  if (auto e = testing::write_torchscript_fixtures(fix.path(), src); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  temp_dir d;
  const std::vector<std::string> sets = {"model.name=torchscript",
                                         "model.file=" + fix.path() + "/bn.pt",
                                         "data.train_inputs=" + fix.path() + "/x_train.npy",
                                         "data.train_targets=" + fix.path() + "/y_train.npy",
                                         "train.global_batch_size=64",
                                         "train.max_steps=1500",
                                         "train.warmup_steps=10",
                                         "train.lr=0.01",
                                         "eval.every_steps=0",
                                         "checkpoint.every_steps=0",
                                         "train.log_every_steps=1",
                                         "cluster.digest_every_steps=5",
                                         "cluster.min_nodes=3"};
  cluster cl(d.path(), set_flags(sets, {}));
  ASSERT_EQ(cl.start({"a", "b", "c"}), "");
  ASSERT_TRUE(cl.wait_step(40, 3)) << cl.logs();
  cl.signal_node("c", SIGKILL);  // a new generation of two
  expect_finished_without_loss(cl, 1500, 2);
  for (const auto& f : events_named(cl.journal(), ev::rank_down::failed_name))
    EXPECT_EQ(f.at("detail").get<std::string>().find("differ"), std::string::npos) << f.dump();
}

// A node whose copy of the data differs (here: one changed number, seen
// only by that node's processes through a bind mount in a mount namespace
// of its own) is refused in one line naming the file and exits 1; the job
// trains on without it.
TEST(Chaos, ANodeWithDifferentDataIsRefusedNeverTrainedOn) {
  temp_dir fix;
  const std::string src = DTACTOR_SOURCE_DIR;
  if (auto e = testing::write_torchscript_fixtures(fix.path(), src); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  if (auto e = testing::run_fixture("unshare -m (a mount namespace: root)", "unshare -m true"); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  const std::string changed = fix.path() + "/x_changed.npy";
  ASSERT_EQ(std::system(("/usr/bin/python3.11 -c \"import numpy as np; x=np.load('" + fix.path() + "/x_train.npy'); x[5,3]+=1; np.save('" + changed +
                         "', x)\"")
                            .c_str()),
            0);
  temp_dir d;
  const std::vector<std::string> sets = {"model.name=torchscript",
                                         "model.file=" + fix.path() + "/mlp.pt",
                                         "data.train_inputs=" + fix.path() + "/x_train.npy",
                                         "data.train_targets=" + fix.path() + "/y_train.npy",
                                         "train.global_batch_size=64",
                                         "train.max_steps=100000000",
                                         "eval.every_steps=0",
                                         "checkpoint.every_steps=0",
                                         "train.log_every_steps=100"};
  cluster cl(d.path(), set_flags(sets, {}));
  ASSERT_EQ(cl.start({"a"}), "");
  ASSERT_TRUE(cl.wait_step(100, 1)) << cl.logs();
  auto b = child_process::spawn({"/usr/bin/unshare", "-m", "/bin/sh", "-c",
                                 "mount --bind " + changed + " " + fix.path() + "/x_train.npy && exec " + kBin + " --role node --coordinator " +
                                     cl.endpoint + " --node-id b --advertise-addr 127.0.0.1 --threads-per-rank 1"},
                                false, d.path() + "/node-b.log");
  ASSERT_TRUE(b);
  auto end = b->wait(120000);
  ASSERT_TRUE(end) << cl.logs();
  EXPECT_EQ(end->exit_code, 1) << cl.logs();
  auto errors = events<ev::job_error>(cl.journal());
  ASSERT_EQ(errors.size(), 1u) << cl.logs();
  EXPECT_EQ(errors[0].at("node"), "b");
  EXPECT_NE(errors[0].at("message").get<std::string>().find("data file '" + fix.path() + "/x_train.npy' on node 'b' differs from the coordinator's"),
            std::string::npos)
      << errors[0].dump();
  for (const auto& g : events<ev::generation_started>(cl.journal()))
    for (const auto& n : g.at("nodes")) EXPECT_NE(n, "b") << "never planned in";
  std::ifstream f(d.path() + "/node-b.log");
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_NE(ss.str().find("dtactor: refused by the coordinator: data file"), std::string::npos) << ss.str();
}

// The coordinator ships a torchscript job's module with the job (into the
// checkpoint store; its name and digest in the register ack): node a starts
// where model.file no longer exists, node b where a different file (not a
// module at all) is at that path; both train the coordinator's module,
// fetched from the store into caches of their own (TMPDIR per node).
TEST(Chaos, NodesTrainTheModuleTheCoordinatorShippedWithoutACopyOfTheirOwn) {
  temp_dir fix, mod;
  const std::string src = DTACTOR_SOURCE_DIR;
  if (auto e = testing::write_torchscript_fixtures(fix.path(), src); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  const std::string module = mod.path() + "/mlp.pt";
  std::filesystem::copy_file(fix.path() + "/mlp.pt", module);
  temp_dir d;
  const std::vector<std::string> sets = {"model.name=torchscript",
                                         "model.file=" + module,
                                         "data.train_inputs=" + fix.path() + "/x_train.npy",
                                         "data.train_targets=" + fix.path() + "/y_train.npy",
                                         "train.global_batch_size=64",
                                         "train.max_steps=100000000",
                                         "eval.every_steps=0",
                                         "checkpoint.every_steps=0",
                                         "train.log_every_steps=10",
                                         "cluster.digest_every_steps=10"};
  cluster cl(d.path(), set_flags(sets, {}));
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::module_shipped>(j).empty(); })) << cl.logs();
  auto shipped = events<ev::module_shipped>(cl.journal());
  EXPECT_EQ(shipped[0].at("uploaded"), true);
  EXPECT_TRUE(std::filesystem::exists(d.path() + "/checkpoints/" + shipped[0].at("object").get<std::string>()));
  std::filesystem::remove(module);
  const char* old_tmp = std::getenv("TMPDIR");
  const std::string saved_tmp = old_tmp ? old_tmp : "";
  std::filesystem::create_directories(d.path() + "/tmp-a");
  std::filesystem::create_directories(d.path() + "/tmp-b");
  ::setenv("TMPDIR", (d.path() + "/tmp-a").c_str(), 1);
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_TRUE(cl.wait_step(20, 1)) << cl.logs();
  { std::ofstream(module) << "not a module: a node's stale or foreign copy\n"; }
  ::setenv("TMPDIR", (d.path() + "/tmp-b").c_str(), 1);
  ASSERT_EQ(cl.start_node("b"), "");
  if (old_tmp)
    ::setenv("TMPDIR", saved_tmp.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  const int64_t at = events<ev::step_completed>(cl.journal()).back().at("step").get<int64_t>();
  ASSERT_TRUE(cl.wait_step(at + 40, 2)) << cl.logs();
  EXPECT_TRUE(events<ev::job_error>(cl.journal()).empty()) << cl.logs();
  for (const char* id : {"a", "b"}) {
    std::ifstream f(d.path() + "/node-" + id + ".log");
    std::stringstream ss;
    ss << f.rdbuf();
    EXPECT_NE(ss.str().find(std::string("model.file ") + (id[0] == 'a' ? "is missing" : "differs") + " here: using the coordinator's"),
              std::string::npos)
        << ss.str();
    EXPECT_NE(ss.str().find("fetched from the checkpoint store"), std::string::npos) << ss.str();
    EXPECT_TRUE(std::filesystem::exists(d.path() + "/tmp-" + id + "/dtactor-" + std::to_string(::getuid()) + "/shipped/" +
                                        shipped[0].at("object").get<std::string>()));
  }
}

void coordinator_restart_does_not_stop_training(const std::string& zero, const std::vector<std::string>& more = {}) {
  temp_dir d;
  cluster cl(d.path(), job_sets(2500, with(more, {"cluster.min_nodes=2", "train.zero=" + zero})));
  const int node_metrics = pick_free_tcp_port().value();
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a", {"--metrics-port", std::to_string(node_metrics)}), "");
  ASSERT_EQ(cl.start_node("b"), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  cl.coord->signal(SIGKILL);
  cl.coord->wait(10000);
  // Training goes on without the coordinator: the node's own step gauge moves.
  const double before = node_step(node_metrics);
  bool moved = false;
  for (int i = 0; i < 500 && !moved; ++i) {
    moved = node_step(node_metrics) >= before + 20;
    if (!moved) cl.nodes.at("a").wait(10);
  }
  EXPECT_TRUE(moved) << "no steps while the coordinator was down (" << before << ")";
  ASSERT_EQ(cl.start_coordinator(), "");
  expect_finished_without_loss(cl, 2500, 2);
}

TEST(Chaos, CoordinatorRestartDoesNotStopTraining) { coordinator_restart_does_not_stop_training("0"); }

// The same with the optimizer state and gradients sharded (train.zero=2).
TEST(Chaos, CoordinatorRestartDoesNotStopTrainingWithShardedState) { coordinator_restart_does_not_stop_training("2"); }

// And with the parameters sharded too (train.zero=3).
TEST(Chaos, CoordinatorRestartDoesNotStopTrainingWithShardedParameters) { coordinator_restart_does_not_stop_training("3"); }

TEST(Chaos, FlappingNodeIsQuarantined) {
  temp_dir d;
  cluster cl(d.path(), job_sets(100000, {"cluster.min_nodes=1", "cluster.flap_max_failures=2", "cluster.quarantine_ms=60000"}));
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_EQ(cl.start_node("a"), "");
  ASSERT_TRUE(cl.wait_step(10)) << cl.logs();
  // Node b crashes right after the first step it takes part in, twice.
  for (int round = 0; round < 2; ++round) {
    ASSERT_EQ(cl.start_node("b", {"--fail-at-step", "0", "--fail-mode", "crash"}), "");
    ASSERT_TRUE(cl.wait_for([&](const std::vector<json>& j) { return static_cast<int>(events<ev::node_lost>(j).size()) > round; })) << cl.logs();
  }
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::node_quarantined>(j).empty(); })) << cl.logs();
  // Its next attempt is refused; the job goes on with node a.
  ASSERT_EQ(cl.start_node("b"), "");
  const int64_t now = events<ev::step_completed>(cl.journal()).back().at("step").get<int64_t>();
  ASSERT_TRUE(cl.wait_step(now + 50)) << cl.logs();
  auto j = cl.journal();
  for (const auto& s : events<ev::step_completed>(j))
    if (s.at("step").get<int64_t>() > now) {
      EXPECT_EQ(s.at("world_size"), 1) << s.dump();
    }
}


// With a fixed seed, losing a node and getting it back (the same world size
// again: cluster.floor_nodes = 2 pauses the survivor meanwhile) ends bitwise
// identical to an uninterrupted run, whether the replacement receives the
// state while the first step trains (the default) or before it.
TEST(Chaos, LossAndReplacementEndsBitwiseIdentical) {
  auto run = [](const std::string& dir, bool fault, const std::string& heal) {
    return crash_and_replace_run(dir, job_sets(120, {"cluster.min_nodes=2", "cluster.floor_nodes=2", "cluster.heal_while_training=" + heal}),
                                 {"a", "b"}, fault, 120);
  };
  temp_dir d1, d2, d3;
  const std::string clean = run(d1.path(), false, "true");
  ASSERT_FALSE(clean.empty());
  for (const auto& [heal, dir] : {std::pair<std::string, std::string>{"true", d2.path()}, {"false", d3.path()}}) {
    SCOPED_TRACE("cluster.heal_while_training=" + heal);
    EXPECT_EQ(clean, run(dir, true, heal));
    const auto j = read_journal(dir + "/journal.jsonl");
    EXPECT_GE(events<ev::recovery_done>(j).size(), 1u);
    bool healed = false;
    for (const auto& r : events<ev::checkpoint_restored>(j)) healed = healed || r.value("while_training", false);
    EXPECT_EQ(healed, heal == "true");
  }
}

// Going on at the smaller world size: same global batch, only the order of
// the gradient sums differs, so the result stays within a tight tolerance.
TEST(Chaos, ShrunkRunEndsCloseToTheUninterruptedOne) {
  auto run = [](const std::string& dir, bool fault) {
    // Both runs start with both nodes (a loaded machine may make one late;
    // the clean run must train at world 2 throughout, the faulty one until
    // b crashes): the start gate is 2, the floor 1.
    cluster cl(dir, job_sets(120, {"cluster.min_nodes=2", "cluster.floor_nodes=1", "eval.max_samples=2000"}));
    EXPECT_EQ(cl.start_coordinator(), "");
    EXPECT_EQ(cl.start_node("a"), "");
    EXPECT_EQ(cl.start_node("b", fault ? std::vector<std::string>{"--fail-at-step", "50", "--fail-mode", "crash"} : std::vector<std::string>{}), "");
    expect_finished_without_loss(cl, 120, fault ? 1 : 2);
    auto fin = events<ev::job_finished>(cl.journal());
    return fin.empty() ? -1.0 : fin[0].at("val_loss").get<double>();
  };
  temp_dir d1, d2;
  const double clean = run(d1.path(), false);
  const double shrunk = run(d2.path(), true);
  ASSERT_GT(clean, 0);
  ASSERT_GT(shrunk, 0);
  EXPECT_NEAR(shrunk, clean, 1e-3 * clean);
}

}  // namespace
}  // namespace dtactor

namespace dtactor {
namespace {

// SIGTERM to the coordinator: ranks stop at a step they agree on, rank 0's
// final checkpoint of that step is saved, then everything ends.
void coordinator_sigterm_stops_with_a_final_checkpoint(const std::vector<std::string>& more) {
  temp_dir d;
  cluster cl(d.path(), job_sets(100000, with(more, {"cluster.min_nodes=2", "checkpoint.every_steps=100000"})));
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30, 2)) << cl.logs();
  cl.coord->signal(SIGTERM);
  auto done = cl.coord->wait(60000);
  ASSERT_TRUE(done) << cl.logs();
  EXPECT_EQ(done->exit_code, 128 + SIGTERM) << done->describe();
  auto j = cl.journal();
  auto stopped = events<ev::job_stopped>(j);
  ASSERT_EQ(stopped.size(), 1u) << cl.logs();
  EXPECT_FALSE(stopped[0].contains("error")) << stopped[0].dump();  // both ranks stopped with the same parameters
  const int64_t at = stopped[0].at("step").get<int64_t>();
  EXPECT_GE(at, 30);
  auto saved = events<ev::checkpoint_saved>(j);
  ASSERT_FALSE(saved.empty()) << cl.logs();
  EXPECT_EQ(saved.back().at("step"), at);
  for (auto& [id, n] : cl.nodes) {
    auto e = n.wait(20000);
    EXPECT_TRUE(e) << "node " << id << " did not stop";
  }
}

TEST(Chaos, CoordinatorSigtermStopsWithAFinalCheckpoint) { coordinator_sigterm_stops_with_a_final_checkpoint({}); }

// The same faults with train.sync = diloco (windows of 20 steps): a hung
// node, a node that leaves (taken out at the next boundary), a coordinator
// killed and restarted (the workers' inner steps go on meanwhile), and a
// stop with a final checkpoint (at the next boundary).
const std::vector<std::string> kDiLoCo = {"train.sync=diloco", "train.sync_every=20"};
TEST(Chaos, DiLoCoSilentNodeIsDeclaredLost) { silent_node_is_declared_lost("0", kDiLoCo); }
TEST(Chaos, DiLoCoLeavingNodeDrainsAtABoundary) { preemption_notice_drains_without_rollback("0", kDiLoCo); }
TEST(Chaos, DiLoCoCoordinatorRestartDoesNotStopTraining) { coordinator_restart_does_not_stop_training("0", kDiLoCo); }
TEST(Chaos, DiLoCoCoordinatorSigtermStopsWithAFinalCheckpointAtABoundary) { coordinator_sigterm_stops_with_a_final_checkpoint(kDiLoCo); }

}  // namespace
}  // namespace dtactor

namespace dtactor {
namespace {

// The journal has a recovery to a world of `world` ranks.
bool recovered_to(const std::vector<json>& j, int world) {
  for (const auto& r : events<ev::recovery_done>(j))
    if (r.at("world_size") == world) return true;
  return false;
}

// train.sync = diloco, one window of 200 steps: node c is killed (kill -9)
// right after step 50, inside the window. The survivors keep their own
// inner steps of that window (none is undone: they go on from where they
// were, not from the anchor at 0), synchronise among themselves at 200,
// and finish; the journal bounds the inner steps lost with c.
TEST(Chaos, DiLoCoSurvivorsKeepTheirWindowWhenAWorkerIsKilled) {
  temp_dir d;
  const auto sets = job_sets(400, {"cluster.min_nodes=3", "cluster.floor_nodes=2", "train.sync=diloco", "train.sync_every=200",
                                   "checkpoint.every_steps=200"});
  cluster cl(d.path(), sets);
  for (auto e : {cl.start_coordinator(), cl.start_node("a"), cl.start_node("b"), cl.start_node("c", {"--fail-at-step", "50", "--fail-mode", "crash"})})
    ASSERT_EQ(e, "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return recovered_to(j, 2); }, 300)) << cl.logs();
  expect_finished_without_loss(cl, 400, 2);
  const auto j = cl.journal();
  const auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  ASSERT_TRUE(rec.back().contains("lost_inner_steps")) << rec.back().dump();
  EXPECT_GE(rec.back().at("lost_inner_steps").get<int64_t>(), 1) << rec.back().dump();
  EXPECT_LE(rec.back().at("lost_inner_steps").get<int64_t>(), 200) << rec.back().dump();
  EXPECT_GT(rec.back().at("resumed_step").get<int64_t>(), 0) << "the survivors went on inside the window, not from its anchor: " << rec.back().dump();
  // The survivors said so, and where their window stood.
  bool kept = false;
  for (const char* id : {"a", "b"}) {
    std::ifstream f(d.path() + "/node-" + id + ".log");
    for (std::string line; std::getline(f, line);)
      kept = kept || line.find("DiLoCo window goes on at step") != std::string::npos;
  }
  EXPECT_TRUE(kept) << cl.logs();
  // The checkpoints at the two boundaries were committed, each written whole by rank 0.
  EXPECT_GE(events<ev::checkpoint_saved>(j).size(), 2u);
}

// Streaming DiLoCo (4 fragments of a 40-step window, each exchange landing
// a step after it left): node c is killed right after step 50, when
// fragment 0's exchange has just left. The survivors drop that exchange,
// keep their own inner steps, send fragment 0 again among themselves and
// finish without losing a completed step.
TEST(Chaos, StreamingDiLoCoSurvivorsResendTheFragmentInFlightWhenAWorkerIsKilled) {
  temp_dir d;
  const auto sets = job_sets(200, {"cluster.min_nodes=3", "cluster.floor_nodes=2", "train.sync=diloco", "train.sync_every=40",
                                   "train.sync_fragments=4", "checkpoint.every_steps=40"});
  cluster cl(d.path(), sets);
  for (auto e : {cl.start_coordinator(), cl.start_node("a"), cl.start_node("b"), cl.start_node("c", {"--fail-at-step", "50", "--fail-mode", "crash"})})
    ASSERT_EQ(e, "");
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return recovered_to(j, 2); }, 300)) << cl.logs();
  expect_finished_without_loss(cl, 200, 2);
  const auto j = cl.journal();
  const auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  EXPECT_GE(rec.back().at("resumed_step").get<int64_t>(), 50) << "the survivors went on from where they were: " << rec.back().dump();
  // Exchanges went on every 10 steps after the recovery, at the smaller world.
  int after = 0;
  int64_t first_after = -1;
  for (const auto& o : events<ev::outer_step>(j))
    if (o.at("world_size") == 2) {
      if (first_after < 0) first_after = o.at("step").get<int64_t>();
      ++after;
    }
  EXPECT_GE(after, 10) << cl.logs();
  // Fragment 0 sent again at 51 lands at 52; had its exchange completed
  // before the loss was noticed, the next one lands at 61.
  EXPECT_TRUE(first_after == 52 || first_after == 61) << first_after << "\n" << cl.logs();
  bool streaming = false;
  for (const char* id : {"a", "b"}) {
    std::ifstream f(d.path() + "/node-" + id + ".log");
    for (std::string line; std::getline(f, line);) streaming = streaming || line.find("4 fragments, overlap 1 step(s), mix 0.50): pseudo-gradients over shared memory") != std::string::npos;
  }
  EXPECT_TRUE(streaming) << cl.logs();
}

// Streaming DiLoCo: a stop with a final checkpoint happens where an
// exchange lands (nothing in flight), and a joiner is taken in there.
const std::vector<std::string> kStreaming = {"train.sync=diloco", "train.sync_every=20", "train.sync_fragments=2"};
TEST(Chaos, StreamingDiLoCoCoordinatorSigtermStopsWithAFinalCheckpoint) { coordinator_sigterm_stops_with_a_final_checkpoint(kStreaming); }

TEST(Chaos, StreamingDiLoCoJoinerIsTakenInWhereAnExchangeLands) {
  temp_dir d;
  const auto sets = job_sets(1500, {"cluster.min_nodes=2", "cluster.floor_nodes=2", "train.sync=diloco", "train.sync_every=20", "train.sync_fragments=2"});
  cluster cl(d.path(), sets);
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  ASSERT_EQ(cl.start_node("c"), "");
  expect_finished_without_loss(cl, 1500, 3);
  const auto j = cl.journal();
  bool joined = false;
  for (const auto& r : events<ev::recovery_done>(j)) {
    if (r.at("world_size") != 3) continue;
    joined = true;
    // Fragment 0 leaves at 10 + 20k, fragment 1 at 20k; each lands a step later.
    EXPECT_EQ(r.at("resumed_step").get<int64_t>() % 10, 1) << r.dump();
  }
  EXPECT_TRUE(joined) << cl.logs();
}

// A node joins a running DiLoCo job: it is taken in at a boundary (the
// plan drains at the next synchronisation) and takes the state from a peer.
TEST(Chaos, DiLoCoJoinerIsTakenInAtABoundaryWithAPeersState) {
  temp_dir d;
  const auto sets = job_sets(1500, {"cluster.min_nodes=2", "cluster.floor_nodes=2", "train.sync=diloco", "train.sync_every=20"});
  cluster cl(d.path(), sets);
  ASSERT_EQ(cl.start({"a", "b"}), "");
  ASSERT_TRUE(cl.wait_step(30)) << cl.logs();
  ASSERT_EQ(cl.start_node("c"), "");
  expect_finished_without_loss(cl, 1500, 3);
  const auto j = cl.journal();
  bool joined = false;
  for (const auto& r : events<ev::recovery_done>(j)) {
    if (r.at("world_size") != 3) continue;
    joined = true;
    // Taken at a boundary (a multiple of 20): the window had not begun.
    EXPECT_EQ(r.at("resumed_step").get<int64_t>() % 20, 0) << r.dump();
    EXPECT_EQ(r.value("lost_inner_steps", int64_t{0}), 0) << r.dump();
  }
  EXPECT_TRUE(joined) << cl.logs();
  EXPECT_GE(events<ev::checkpoint_restored>(j).size(), 1u) << "the joiner took the state from a peer";
}

}  // namespace
}  // namespace dtactor
