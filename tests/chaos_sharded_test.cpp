// Sharded state end to end (train.zero 1 to 3): real coordinator, node and
// rank processes on loopback; a lost node's shards come from their
// replicas, or from the checkpoint when their only holder is gone, and
// sharded checkpoints resume at another world size and level. As
// tests/chaos_test.cpp, each test waits for journal events, never for fixed
// times.
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

// train.zero=1, 2 and 3 over three nodes (each shard of the optimizer
// state, with 2 of the summed gradients too, with 3 of the parameters too,
// on two of them): node c crashes at
// step 50 and comes back empty; its shards come from their replicas on the
// survivors, not from disk (no checkpoint is written before the end), and
// the run ends bit for bit where the replicated job (zero=0) without a
// fault ends: the clipping norm is the same ranges added in the same order
// at every level (model/grad_norm).
void sharded_state_survives_a_lost_node(const std::string& zero) {
  auto run = [](const std::string& dir, const std::string& zero, bool fault) {
    return crash_and_replace_run(dir,
                                 job_sets(120, {"cluster.min_nodes=3", "cluster.floor_nodes=3", "cluster.max_nodes=3", "cluster.settle_ms=600000",
                                                "checkpoint.every_steps=1000", "train.zero=" + zero}),
                                 {"a", "b", "c"}, fault, 120);
  };
  temp_dir d1, d2;
  const std::string faulty = run(d2.path(), zero, true);
  const std::string clean = run(d1.path(), "0", false);
  ASSERT_FALSE(clean.empty());
  EXPECT_EQ(clean, faulty) << "zero=" << zero << " with a lost and replaced node ends where the run without a fault ends";
  const auto j = read_journal(d2.path() + "/journal.jsonl");
  const auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  // The node came back: its shards came from their replicas, not from disk.
  EXPECT_EQ(rec.back().at("optimizer_source"), "replica") << rec.back().dump();
  EXPECT_GT(rec.back().at("reshard_bytes").get<uint64_t>(), 0u);
  bool healed = false;
  for (const auto& r : events<ev::checkpoint_restored>(j)) {
    EXPECT_NE(r.at("source"), "disk") << r.dump();
    healed = healed || r.value("while_training", false);
  }
  // At zero = 1 and 2 the replacement took the state, and every rank its
  // moments, while the first step at world 3 trained (rank/healing).
  EXPECT_EQ(healed, zero != "3");
  // Each rank said what it holds: a third of the state's optimizer moments
  // times two holders, so less than all of them (zero=3: less than all the
  // parameters, which the fault-free zero=0 run's ranks hold).
  uint64_t all_params = 0;
  for (const auto& e : events_named(read_journal(d1.path() + "/journal.jsonl"), "resources"))
    for (const auto& r : e.at("ranks"))
      if (r.contains("param_bytes")) all_params = std::max(all_params, r.at("param_bytes").get<uint64_t>());
  ASSERT_GT(all_params, 0u);
  bool reported = false;
  for (const auto& e : events_named(j, "resources"))
    for (const auto& r : e.at("ranks")) {
      if (!r.contains("optimizer_state_bytes")) continue;
      reported = true;
      const uint64_t params = zero == "3" ? all_params : r.at("param_bytes").get<uint64_t>();
      if (zero == "3") {
        EXPECT_LT(r.at("param_bytes").get<uint64_t>(), all_params) << r.dump();
      }
      EXPECT_LT(r.at("optimizer_state_bytes").get<uint64_t>(), 2 * params) << r.dump();
      EXPECT_GT(r.at("optimizer_state_bytes").get<uint64_t>(), 0u) << r.dump();
      // zero=2: the gradients of its shards only; zero=1: all of them, and
      // a second copy in the reducer's buckets.
      if (zero != "1")
        EXPECT_LT(r.at("grad_bytes").get<uint64_t>(), params) << r.dump();
      else
        EXPECT_GE(r.at("grad_bytes").get<uint64_t>(), 2 * params) << r.dump();
    }
  EXPECT_TRUE(reported) << "resources events carry the state bytes";
  // The nodes' logs say the optimizer state is sharded and that shards moved.
  bool sharded = false, moved = false;
  for (const char* id : {"a", "b", "c"}) {
    std::ifstream f(d2.path() + "/node-" + id + ".log");
    for (std::string line; std::getline(f, line);) {
      if (line.find("sharded (train.zero=" + zero + ")") == std::string::npos) continue;
      sharded = true;
      moved = moved || line.find(" 0 bytes moved") == std::string::npos;
    }
  }
  EXPECT_TRUE(sharded);
  EXPECT_TRUE(moved);
}

TEST(Chaos, ShardedOptimizerStateSurvivesALostNodeFromItsReplicas) { sharded_state_survives_a_lost_node("1"); }

TEST(Chaos, ShardedGradientsAndOptimizerStateSurviveALostNodeFromItsReplicas) { sharded_state_survives_a_lost_node("2"); }

// train.zero=3: the parameters of c's shards come from their holders too.
TEST(Chaos, ShardedParametersSurviveALostNodeFromItsReplicas) { sharded_state_survives_a_lost_node("3"); }

// Nodes a, b and c; c crashes (kill -9) right after step 50, is declared
// lost, and is started again (empty). "" or what went wrong.
std::string crash_c_at_step_50_and_start_it_again(cluster& cl) {
  for (auto e : {cl.start_coordinator(), cl.start_node("a"), cl.start_node("b"), cl.start_node("c", {"--fail-at-step", "50", "--fail-mode", "crash"})})
    if (!e.empty()) return e;
  if (!cl.wait_for([](const std::vector<json>& j) { return !events<ev::node_lost>(j).empty(); })) return "node c was never declared lost";
  return cl.start_node("c");
}

// zero=2 (or 3) with one holder a shard (train.zero_replicas=1): node c's
// crash at step 50 takes its shard with it. The ranks go back to the newest
// committed checkpoint, each reading its own shards from the parts that hold
// them (rank 0 also the replicated part, sent on to the others; at zero=3
// it holds no parameter, which each rank reads with its shards), and the
// run ends bit for bit where the fault-free run ends.
void a_shard_lost_with_its_only_holder_comes_back_from_the_checkpoint(int zero) {
  const auto sets = job_sets(80, {"cluster.min_nodes=3", "cluster.floor_nodes=3", "cluster.max_nodes=3", "cluster.settle_ms=600000",
                                  "checkpoint.every_steps=20", "train.zero=" + std::to_string(zero), "train.zero_replicas=1"});
  auto finished = [](const std::vector<json>& j) { return !events<ev::job_finished>(j).empty(); };
  temp_dir d1, d2;
  std::string clean, faulty;
  {
    cluster cl(d1.path(), sets);
    ASSERT_EQ(cl.start({"a", "b", "c"}), "");
    ASSERT_TRUE(cl.wait_for(finished, 300)) << cl.logs();
    clean = events<ev::job_finished>(cl.journal())[0].at("params_digest").get<std::string>();
  }
  cluster cl(d2.path(), sets);
  ASSERT_EQ(crash_c_at_step_50_and_start_it_again(cl), "") << cl.logs();
  ASSERT_TRUE(cl.wait_for(finished, 300)) << cl.logs();
  const auto j = cl.journal();
  faulty = events<ev::job_finished>(j)[0].at("params_digest").get<std::string>();
  EXPECT_EQ(faulty, clean) << "back to the checkpoint and on, bit for bit\n" << cl.logs();
  const auto rec = events<ev::recovery_done>(j);
  ASSERT_GE(rec.size(), 1u);
  EXPECT_EQ(rec.back().at("optimizer_source"), "checkpoint") << rec.back().dump();
  // Every rank read its shards from the checkpoint; the ranks other than
  // global rank 0 read less than all of it.
  int reads = 0, partial = 0;
  for (const char* id : {"a", "b", "c"}) {
    std::ifstream f(d2.path() + "/node-" + id + ".log");
    for (std::string line; std::getline(f, line);) {
      const auto at = line.find("optimizer shards read from the checkpoint at step ");
      if (at == std::string::npos) continue;
      ++reads;
      unsigned long long got = 0, all = 0;
      long long step = 0;
      if (std::sscanf(line.c_str() + at, "optimizer shards read from the checkpoint at step %lld: %llu of its %llu bytes", &step, &got, &all) == 3 &&
          got < all)
        ++partial;
    }
  }
  EXPECT_GE(reads, 3) << cl.logs();
  EXPECT_GE(partial, 2) << cl.logs();
}

TEST(Chaos, AShardLostWithItsOnlyHolderComesBackFromTheCheckpoint) { a_shard_lost_with_its_only_holder_comes_back_from_the_checkpoint(2); }
TEST(Chaos, AShardOfParametersLostWithItsOnlyHolderComesBackFromTheCheckpoint) {
  a_shard_lost_with_its_only_holder_comes_back_from_the_checkpoint(3);
}

// The same loss with no checkpoint committed (checkpoint.every_steps=0: only
// at the end): nothing holds that shard's state any more, so the job starts
// over from step 0 and finishes, and the journal's recovery says every step
// before it was lost (it used to fail the same way in every generation).
TEST(Chaos, AShardLostWithItsOnlyHolderAndNoCheckpointStartsTheJobOver) {
  const auto sets = job_sets(80, {"cluster.min_nodes=3", "cluster.floor_nodes=3", "cluster.max_nodes=3", "cluster.settle_ms=600000",
                                  "checkpoint.every_steps=0", "train.zero=2", "train.zero_replicas=1"});
  temp_dir d;
  cluster cl(d.path(), sets);
  ASSERT_EQ(crash_c_at_step_50_and_start_it_again(cl), "") << cl.logs();
  ASSERT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !events<ev::job_finished>(j).empty(); }, 300)) << cl.logs();
  const auto j = cl.journal();
  bool restarted = false;
  for (const auto& r : events<ev::recovery_done>(j)) {
    if (r.value("optimizer_source", "") != "restart") continue;
    restarted = true;
    EXPECT_EQ(r.at("resumed_step"), 0) << r.dump();
    EXPECT_GE(r.at("lost_steps").get<int64_t>(), 40) << r.dump();  // the crash came right after step 50
  }
  EXPECT_TRUE(restarted) << cl.logs();
  EXPECT_NE(cl.logs().find("the job starts over from step 0"), std::string::npos) << cl.logs();
  EXPECT_EQ(events<ev::job_finished>(j)[0].at("step"), 80);
}

// The whole stream of the newest committed checkpoint in a run directory.
// The stream of the newest valid checkpoint (or of the one at step `at`).
std::string newest_stream(const std::string& run_dir, int64_t& step, int& parts, pb::checkpoint_meta* out_meta = nullptr, int64_t at = -1) {
  auto store = checkpoint_store::open_readonly(run_dir + "/checkpoints");
  if (!store) return "";
  pb::checkpoint_meta meta;
  if (at >= 0) {
    auto m = store->read_manifest(manifest_name(at));
    if (!m || !store->verify(m.value(), true)) return "";
    meta = std::move(m.value());
  } else {
    auto newest = store->newest_valid([](const std::string&, const std::string&) {}, true);
    if (!newest || !newest->has_value()) return "";
    meta = **newest;
  }
  step = meta.step();
  parts = meta.parts_size();
  if (out_meta) *out_meta = meta;
  std::string out;
  auto st = store->read_stream(meta, [&](uint64_t at, const char* data, size_t n) -> status {
    if (at != out.size()) return make_error("out of order");
    out.append(data, n);
    return {};
  });
  return st ? out : "";
}

// Sharded checkpoints (train.zero=1, 2 and 3): each rank writes its share of
// the replicated bytes and the windows of the shards it is the primary of;
// the committed stream is byte for byte the one zero=0 writes at the same
// step. The runs then resume on two nodes, at their own zero level and
// across levels (zero=2 from zero=0's checkpoint, zero=0 from zero=2's), and
// all end alike. Clipping is on and small (every step clips): the norm is
// the same ranges added in the same order at every level and world size,
// so resumes across levels and worlds change no bit. The zero=2
// and zero=3 runs write their parts straight from the state
// (checkpoint.direct; at zero=3 each parameter by the primary of its
// shard, the only rank holding it between steps besides its replicas): the
// same bytes, with no part-sized buffer, at step 20 read while step 21
// computed its gradients as well as at the final step.
TEST(Chaos, ShardedCheckpointsAreTheReplicatedOnesAndResumeAtAnotherWorldSize) {
  auto sets = [](int steps, int nodes, const std::string& zero) {
    return job_sets(steps, {"cluster.min_nodes=" + std::to_string(nodes), "cluster.max_nodes=" + std::to_string(nodes), "cluster.settle_ms=600000",
                            "checkpoint.every_steps=20", "train.grad_clip=0.05", "train.zero=" + zero,
                            std::string("checkpoint.direct=") + (zero == "2" || zero == "3" ? "true" : "false")});
  };
  temp_dir d0, d1, d2, d3;
  const std::map<std::string, std::string> dirs = {{"0", d0.path()}, {"1", d1.path()}, {"2", d2.path()}, {"3", d3.path()}};
  for (const auto& [zero, dir] : dirs) {
    cluster cl(dir, sets(40, 3, zero));
    ASSERT_EQ(cl.start({"a", "b", "c"}), "");
    expect_finished_without_loss(cl, 40, 3);
  }
  for (const auto& [zero, dir] : dirs) {
    auto j = read_journal(dir + "/journal.jsonl");
    auto saved = events<ev::checkpoint_saved>(j);
    ASSERT_EQ(saved.size(), 2u) << "zero=" << zero;
    for (const auto& e : saved) EXPECT_EQ(e.at("direct_ranks").get<int>(), zero == "2" || zero == "3" ? 3 : 0) << e.dump();
  }
  for (const auto& [at, zero] : std::vector<std::pair<int64_t, std::string>>{{20, "1"}, {20, "2"}, {20, "3"}, {40, "1"}, {40, "2"}, {40, "3"}}) {
    SCOPED_TRACE("zero=" + zero + " at step " + std::to_string(at));
    int64_t s0 = -1;
    int p0 = 0;
    const std::string replicated = newest_stream(d0.path(), s0, p0, nullptr, at);
    ASSERT_FALSE(replicated.empty());
    EXPECT_EQ(s0, at);
    EXPECT_EQ(p0, 3);
    int64_t s1 = -1;
    int p1 = 0;
    pb::checkpoint_meta meta;
    const std::string sharded = newest_stream(dirs.at(zero), s1, p1, &meta, at);
    // Where they differ first, by tensor. Not compared: train/rng, the CPU
    // generator of whichever rank wrote those bytes (ranks re-seed it from
    // (seed, step, rank) before every step, so it differs between ranks and
    // does not affect a resume); sharding splits the replicated bytes
    // differently, so another rank writes it.
    std::string first_diff;
    ASSERT_EQ(replicated.size(), sharded.size());
    for (const auto& t : meta.tensors()) {
      if (t.name() == "train/rng") continue;
      for (uint64_t i = t.offset(); i < t.offset() + t.size() && first_diff.empty(); ++i)
        if (replicated[i] != sharded[i]) first_diff = t.name() + " at byte " + std::to_string(i - t.offset());
    }
    EXPECT_EQ(s1, at);
    EXPECT_GT(p1, 3) << "sharded ranks write several ranges each";
    EXPECT_EQ(first_diff, "") << "the sharded checkpoint's stream differs from zero=0's";
  }
  // Resumed by new runs (their own journals) on two nodes: {zero level, from}.
  std::map<std::string, std::string> fin;
  for (const auto& [zero, from] :
       std::vector<std::pair<std::string, std::string>>{{"0", "0"}, {"1", "1"}, {"2", "2"}, {"2", "0"}, {"0", "2"}, {"3", "3"}, {"3", "0"}, {"0", "3"}}) {
    SCOPED_TRACE("zero=" + zero + " from zero=" + from + "'s checkpoint");
    temp_dir r;
    // A copy: a resumed run writes its own checkpoints beside the one it read.
    std::filesystem::copy(dirs.at(from) + "/checkpoints", r.path() + "/from", std::filesystem::copy_options::recursive);
    auto s = sets(60, 2, zero);
    s.push_back("--set");
    s.push_back("checkpoint.dir=" + r.path() + "/from");
    cluster cl(r.path(), s);
    ASSERT_EQ(cl.start({"a", "b"}), "");
    expect_finished_without_loss(cl, 60, 2);
    auto j = cl.journal();
    bool from_disk = false;
    for (const auto& e : events<ev::checkpoint_restored>(j)) from_disk = from_disk || (e.at("source") == "disk" && e.at("step") == 40);
    EXPECT_TRUE(from_disk) << cl.logs();
    auto f = events<ev::job_finished>(j);
    ASSERT_EQ(f.size(), 1u);
    fin[zero + " from " + from] = f[0].at("params_digest").get<std::string>();
  }
  for (const auto& [which, digest] : fin) EXPECT_EQ(digest, fin.at("0 from 0")) << which;
}

}  // namespace
}  // namespace dtactor
