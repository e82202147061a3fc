#pragma once
// What the fault tests on real processes share (tests/chaos_test.cpp on
// loopback, tests/hosts_test.cpp on separate hosts): the job they run and
// the checks they end with. GoogleTest assertions; needs cluster_harness.hpp.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cluster_harness.hpp"

namespace dtactor::testing {

// A small ViT whose steps take a few milliseconds, reported every step (the
// tests compare step numbers around each fault), checkpointed at the steps
// checkpoints fall due at (never deferred while the previous one is still
// stored: the tests read them by step).
inline std::vector<std::string> job_sets(int steps, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = {"model.dim=16",           "model.layers=1",        "model.heads=2",          "model.mlp_ratio=2",
                                   "train.global_batch_size=32", "train.warmup_steps=5", "train.lr=0.003",        "eval.max_samples=500",
                                   "eval.every_steps=0",     "checkpoint.every_steps=20", "train.log_every_steps=1", "cluster.digest_every_steps=10",
                                   "checkpoint.defer_while_writing=false", "train.max_steps=" + std::to_string(steps)};
  return set_flags(sets, extra);
}

// The checks every fault test ends with: the job finished at max_steps with
// identical parameters on every rank, no recovery lost a
// completed step, and step numbers never went backwards across a recovery.
inline void expect_finished_without_loss(cluster& cl, int64_t max_steps, int expect_world) {
  ASSERT_TRUE(cl.coord);
  auto done = cl.coord->wait(150000);
  ASSERT_TRUE(done) << "the job did not finish\n" << cl.logs();
  EXPECT_EQ(done->exit_code, 0) << done->describe() << "\n" << cl.logs();
  auto j = cl.journal();
  auto fin = journal_events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u) << cl.logs();
  EXPECT_EQ(fin[0].at("step"), max_steps);
  EXPECT_FALSE(fin[0].contains("error")) << fin[0].dump();
  if (expect_world > 0) {
    EXPECT_EQ(fin[0].at("world_size"), expect_world) << cl.logs();
  }
  for (const auto& r : journal_events<ev::recovery_done>(j)) {
    EXPECT_EQ(r.at("lost_steps"), 0) << r.dump() << "\n" << cl.logs();
  }
  // Steps are journaled once every rank reported them: a recovery resumes
  // at or after the last one.
  int64_t prev = 0;
  uint64_t gen = 0;
  for (const auto& e : j) {
    if (e.at("event").get<std::string>() != ev::step_completed::name) continue;
    const int64_t s = e.at("step").get<int64_t>();
    const uint64_t g = e.value("generation", uint64_t{0});
    if (g == gen) {
      EXPECT_GT(s, prev) << e.dump();
    } else {
      EXPECT_GE(s, prev) << "generation " << g << " went back to step " << s << " from " << prev;
    }
    prev = std::max(prev, s);
    gen = g;
  }
}

// A job on `nodes` (the last one, with `fault`, crashes at step 50 and is
// started again once lost), run to `steps`; the final parameters' digest.
inline std::string crash_and_replace_run(const std::string& dir, const std::vector<std::string>& sets, const std::vector<std::string>& nodes, bool fault,
                                         int steps) {
  cluster cl(dir, sets);
  EXPECT_EQ(cl.start_coordinator(), "");
  for (size_t i = 0; i + 1 < nodes.size(); ++i) EXPECT_EQ(cl.start_node(nodes[i]), "");
  if (fault) {
    EXPECT_EQ(cl.start_node(nodes.back(), {"--fail-at-step", "50", "--fail-mode", "crash"}), "");
    EXPECT_TRUE(cl.wait_for([](const std::vector<json>& j) { return !journal_events<ev::node_lost>(j).empty(); })) << cl.logs();
  }
  EXPECT_EQ(cl.start_node(nodes.back()), "");
  expect_finished_without_loss(cl, steps, static_cast<int>(nodes.size()));
  auto fin = journal_events<ev::job_finished>(cl.journal());
  return fin.empty() ? std::string{} : fin[0].at("params_digest").get<std::string>();
}

}  // namespace dtactor::testing
