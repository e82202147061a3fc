// train.precision = bf16 through faults on real processes: a lost node at
// zero=2 and 3, and checkpoints resumed at another level, world and
// precision.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "chaos_checks.hpp"
#include "cluster_harness.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::cluster;
using testing::crash_and_replace_run;
using testing::events;
using testing::expect_finished_without_loss;
using testing::job_sets;
using testing::read_journal;
using testing::temp_dir;

// train.precision = bf16 at zero=2 and 3: node c's crash at step 50 loses
// no step, its shards (the moments and gradients of the fp32 masters; at 3
// the masters too) come from their replicas, and the run ends bit for bit
// where the fault-free bf16 run at that level ends.
TEST(Chaos, Bf16ShardedStateSurvivesALostNodeBitForBit) {
  for (const std::string zero : {"2", "3"}) {
    SCOPED_TRACE("zero=" + zero);
    auto run = [&zero](const std::string& dir, bool fault) {
      return crash_and_replace_run(dir,
                                   job_sets(120, {"cluster.min_nodes=3", "cluster.floor_nodes=3", "cluster.max_nodes=3", "cluster.settle_ms=600000",
                                                  "checkpoint.every_steps=1000", "train.zero=" + zero, "train.precision=bf16"}),
                                   {"a", "b", "c"}, fault, 120);
    };
    temp_dir d1, d2;
    const std::string faulty = run(d2.path(), true);
    const std::string clean = run(d1.path(), false);
    ASSERT_FALSE(clean.empty());
    EXPECT_EQ(clean, faulty);
    const auto j = read_journal(d2.path() + "/journal.jsonl");
    const auto rec = events<ev::recovery_done>(j);
    ASSERT_GE(rec.size(), 1u);
    EXPECT_EQ(rec.back().at("optimizer_source"), "replica") << rec.back().dump();
    // The replacement healed while training at 2 (the bf16 copies from the
    // root, masters and moments from their holders); at 3 before the step.
    bool healed = false;
    for (const auto& r : events<ev::checkpoint_restored>(j)) healed = healed || r.value("while_training", false);
    EXPECT_EQ(healed, zero == "2");
  }
}


// train.precision = bf16 at zero=0: the replacement heals while the first
// step trains (the default), the fp32 masters sent first. Its forward
// computes with their rounding, so it ends bit for bit where the fault-free
// bf16 run ends; a receiver computing with the copies of its initial
// parameters would sum another gradient into that step.
TEST(Chaos, Bf16ReplacementHealsWhileTrainingBitForBit) {
  auto run = [](const std::string& dir, bool fault) {
    return crash_and_replace_run(dir, job_sets(120, {"cluster.min_nodes=2", "cluster.floor_nodes=2", "train.precision=bf16"}), {"a", "b"}, fault, 120);
  };
  temp_dir d1, d2;
  const std::string clean = run(d1.path(), false);
  ASSERT_FALSE(clean.empty());
  EXPECT_EQ(clean, run(d2.path(), true));
  bool healed = false;
  for (const auto& r : events<ev::checkpoint_restored>(read_journal(d2.path() + "/journal.jsonl")))
    healed = healed || r.value("while_training", false);
  EXPECT_TRUE(healed);
}

// train.precision = bf16 at zero=1 shards the fp32 masters: every rank
// starts without the whole model (its shards' initial values made at the
// first generation), keeps its shards' masters, and takes the bf16 copies
// from their primaries after each update. The sums and the updates are
// zero=0's, so a 3-node job with a node crashed and replaced ends on the
// same parameters, bit for bit, as a fault-free zero=0 bf16 job. The
// replacement heals while training: it computes its first step with the
// root's bf16 copies while its shards' masters and moments come from their
// holders; the others compute with their copies as they are, although
// some of their newly held masters are still on their way.
TEST(Chaos, Bf16ShardedMastersAtLevelOneEndBitForBitAsLevelZero) {
  auto run = [](const std::string& dir, const std::string& zero, bool fault) {
    return crash_and_replace_run(dir,
                                 job_sets(100, {"cluster.min_nodes=3", "cluster.floor_nodes=3", "cluster.max_nodes=3", "cluster.settle_ms=600000",
                                                "checkpoint.every_steps=1000", "train.zero=" + zero, "train.precision=bf16"}),
                                 {"a", "b", "c"}, fault, 100);
  };
  temp_dir d0, d1;
  const std::string plain = run(d0.path(), "0", false);
  ASSERT_FALSE(plain.empty());
  EXPECT_EQ(run(d1.path(), "1", true), plain);
  bool healed = false;
  for (const auto& r : events<ev::checkpoint_restored>(read_journal(d1.path() + "/journal.jsonl"))) healed = healed || r.value("while_training", false);
  EXPECT_TRUE(healed);
}

// A bf16 job's checkpoints (zero=3 on three nodes) hold the fp32 masters in
// the stream every level writes: they resume on two nodes at zero=0 in
// bf16, at zero=2 in fp32 and at zero=1 in bf16 (its masters sharded
// too), from the checkpoint, and each finishes.
TEST(Chaos, Bf16CheckpointsResumeAtAnotherLevelWorldAndPrecision) {
  auto sets = [](int steps, int nodes, const std::string& zero, const std::string& precision) {
    return job_sets(steps, {"cluster.min_nodes=" + std::to_string(nodes), "cluster.max_nodes=" + std::to_string(nodes), "cluster.settle_ms=600000",
                            "checkpoint.every_steps=20", "train.zero=" + zero, "train.precision=" + precision});
  };
  temp_dir d;
  {
    cluster cl(d.path(), sets(40, 3, "3", "bf16"));
    ASSERT_EQ(cl.start({"a", "b", "c"}), "");
    expect_finished_without_loss(cl, 40, 3);
  }
  for (const auto& [zero, precision] : std::vector<std::pair<std::string, std::string>>{{"0", "bf16"}, {"2", "fp32"}, {"1", "bf16"}}) {
    SCOPED_TRACE("zero=" + zero + " " + precision);
    temp_dir r;
    std::filesystem::copy(d.path() + "/checkpoints", r.path() + "/from", std::filesystem::copy_options::recursive);
    auto s = sets(60, 2, zero, precision);
    s.push_back("--set");
    s.push_back("checkpoint.dir=" + r.path() + "/from");
    cluster cl(r.path(), s);
    ASSERT_EQ(cl.start({"a", "b"}), "");
    expect_finished_without_loss(cl, 60, 2);
    bool from_disk = false;
    for (const auto& e : events<ev::checkpoint_restored>(cl.journal())) from_disk = from_disk || (e.at("source") == "disk" && e.at("step") == 40);
    EXPECT_TRUE(from_disk) << cl.logs();
  }
}


}  // namespace
}  // namespace dtactor
