// A checkpoint damaged after the coordinator's start-up check (issue 47,
// finding 5), with real processes on loopback: rank 0 refuses it (checksum),
// the coordinator marks it bad for the job and the next generation resumes
// from the previous checkpoint; with every checkpoint damaged the job fails
// with one line and a non-zero exit. Before, the coordinator planned the
// same checkpoint generation after generation (91 in 60 s).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "cluster_harness.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::cluster;
using testing::journal_events;
using testing::set_flags;
using testing::temp_dir;

const std::string kBin = DTACTOR_BINARY;

// A tiny job checkpointing every 10 steps.
std::vector<std::string> sets(int steps) {
  return set_flags({"model.dim=16", "model.layers=1", "model.heads=2", "model.mlp_ratio=2", "train.global_batch_size=32", "train.warmup_steps=5",
                    "train.lr=0.003", "eval.max_samples=200", "eval.every_steps=0", "checkpoint.every_steps=10", "train.log_every_steps=5",
                    "cluster.min_nodes=1", "train.max_steps=" + std::to_string(steps)});
}

// Flips one byte in the middle of every part of the checkpoint at `step`.
int damage(const std::string& dir, int64_t step) {
  char prefix[32];
  std::snprintf(prefix, sizeof prefix, "ckpt-%09lld.", static_cast<long long>(step));
  int parts = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0 || e.path().extension() != ".part") continue;
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    const auto mid = static_cast<std::streamoff>(std::filesystem::file_size(e.path()) / 2);
    char c = 0;
    f.seekg(mid);
    f.get(c);
    f.seekp(mid);
    f.put(static_cast<char>(c ^ 0x5a));
    ++parts;
  }
  return parts;
}

// A run to step 20 (checkpoints at 10 and 20), then a coordinator resuming
// it to step 30 from the checkpoint at 20; once that coordinator has
// checked the checkpoint (checkpoint_found), the checkpoints at `damaged`
// are damaged and a node starts. Returns the cluster of the second run.
void resume_after_damage(cluster& cl, const std::vector<int64_t>& damaged) {
  {
    std::vector<std::string> args = {kBin, "local", "--nodes", "1", "--nproc-per-node", "1", "--run-dir", cl.run_dir};
    for (const auto& s : sets(20)) args.push_back(s);
    auto first = child_process::spawn(args, false, cl.run_dir + "/first.log");
    ASSERT_TRUE(first) << first.message();
    auto e = first->wait(120000);
    ASSERT_TRUE(e && e->exit_code == 0) << cl.logs();
  }
  cl.sets = sets(30);
  ASSERT_EQ(cl.start_coordinator(), "");
  ASSERT_TRUE(cl.wait_for([](const auto& j) { return !journal_events<ev::checkpoint_found>(j).empty(); }, 60)) << cl.logs();
  ASSERT_EQ(journal_events<ev::checkpoint_found>(cl.journal())[0].at("step"), 20);
  for (int64_t step : damaged) ASSERT_GT(damage(cl.run_dir + "/checkpoints", step), 0) << "no part of step " << step;
  ASSERT_EQ(cl.start_node("n0"), "");
}

// Lines of `text` containing `what`.
int lines_with(const std::string& text, const std::string& what) {
  int n = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) n += line.find(what) != std::string::npos;
  return n;
}

TEST(CheckpointRefusal, ACheckpointARankRefusesIsMarkedBadAndTheJobResumesFromThePreviousOne) {
  temp_dir d;
  cluster cl(d.path(), {});
  resume_after_damage(cl, {20});
  if (HasFatalFailure()) return;
  auto done = cl.coord->wait(150000);
  ASSERT_TRUE(done) << "the job did not end\n" << cl.logs();
  EXPECT_EQ(done->exit_code, 0) << done->describe() << "\n" << cl.logs();
  auto j = cl.journal();
  auto refused = journal_events<ev::checkpoint_refused>(j);
  ASSERT_EQ(refused.size(), 1u) << cl.logs();
  EXPECT_EQ(refused[0].at("step"), 20);
  EXPECT_EQ(refused[0].at("fallback_step"), 10);
  EXPECT_NE(refused[0].at("reason").get<std::string>().find("checksum mismatch in part"), std::string::npos) << refused[0].dump();
  auto restored = journal_events<ev::checkpoint_restored>(j);
  ASSERT_FALSE(restored.empty()) << cl.logs();
  EXPECT_EQ(restored.back().at("step"), 10);
  auto fin = journal_events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 2u) << cl.logs();  // the first run's and this one's
  EXPECT_EQ(fin[1].at("step"), 30);
  // The first run's one generation, then at most: the refused plan, the
  // fallback (and one more, should the node's rank restart around it).
  EXPECT_LE(journal_events<ev::generation_started>(j).size(), 4u) << cl.logs();
  EXPECT_EQ(testing::journal_events_named(j, ev::rank_down::failed_name).size(), 1u) << cl.logs();
}

TEST(CheckpointRefusal, WithEveryCheckpointDamagedTheJobFailsWithOneLineAndNeverPlansOneTwice) {
  temp_dir d;
  cluster cl(d.path(), {});
  resume_after_damage(cl, {10, 20});
  if (HasFatalFailure()) return;
  auto done = cl.coord->wait(150000);
  ASSERT_TRUE(done) << "the job did not end\n" << cl.logs();
  EXPECT_EQ(done->exit_code, 1) << done->describe() << "\n" << cl.logs();
  auto j = cl.journal();
  auto refused = journal_events<ev::checkpoint_refused>(j);
  ASSERT_EQ(refused.size(), 2u) << cl.logs();
  EXPECT_EQ(refused[0].at("step"), 20);
  EXPECT_EQ(refused[0].at("fallback_step"), 10);
  EXPECT_EQ(refused[1].at("step"), 10);
  EXPECT_EQ(refused[1].at("fallback_step"), -1);
  auto failed = journal_events<ev::job_failed>(j);
  ASSERT_EQ(failed.size(), 1u) << cl.logs();
  std::ifstream f(cl.run_dir + "/coordinator.log");
  const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // The final line, without "start it again to resume": nothing is left to resume from.
  EXPECT_EQ(lines_with(log, "dtactor: the job stops at step 20: rank 0 on node 'n0' refused the checkpoint at step 10 ("), 1) << log;
  EXPECT_EQ(lines_with(log, "start it again"), 0) << log;
  EXPECT_EQ(lines_with(log, "no other committed checkpoint is left that no rank refused"), 2) << log;  // the job's log line and the final one
  EXPECT_EQ(testing::journal_events_named(j, ev::rank_down::failed_name).size(), 2u) << log;
  auto node = cl.nodes.at("n0").wait(30000);
  EXPECT_TRUE(node) << "the node did not end with the job\n" << log;
}

}  // namespace
}  // namespace dtactor
