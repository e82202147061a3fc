#include "app/train_command.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "model/trainer.hpp"
#include "storage/checkpoint_store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

namespace dtactor {
namespace {

using testing::quiet;
using testing::events;
using testing::read_journal;
using testing::temp_dir;
using testing::tiny_vit_config;

TEST(Trainer, LossFallsAndJournalRecordsTheRun) {
  temp_dir d;
  auto cfg = tiny_vit_config({"train.max_steps=60", "eval.every_steps=30"});
  auto r = run_training(cfg, quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  EXPECT_TRUE(r->finished);
  EXPECT_EQ(r->step, 60);
  auto j = read_journal(d.path() + "/journal.jsonl");
  auto steps = events<ev::step_completed>(j);
  ASSERT_GE(steps.size(), 10u);
  EXPECT_LT(steps.back().at("loss_avg").get<double>(), 0.75 * steps.front().at("loss_avg").get<double>());
  for (const auto& s : steps) {
    for (const char* k : {"t", "step", "loss", "lr", "samples_per_s"}) EXPECT_TRUE(s.contains(k)) << k;
    EXPECT_GT(s.at("samples_per_s").get<double>(), 0);
  }
  auto evals = events<ev::eval_done>(j);
  ASSERT_EQ(evals.size(), 2u);  // step 30 and the end
  EXPECT_GT(evals.back().at("accuracy").get<double>(), 0.4);  // 10 classes: chance is 0.1
  auto fin = events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u);
  EXPECT_EQ(fin[0].at("step"), 60);
  EXPECT_EQ(fin[0].at("params_digest"), r->params_digest);
  ASSERT_EQ(events<ev::checkpoint_saved>(j).size(), 1u);  // the final one
  EXPECT_TRUE(std::filesystem::exists(d.path() + "/config.toml"));
}

// The journal's resources say what the rank holds: its parameters,
// gradients and moments, and the host buffer its checkpoint part is staged
// in (kept from the first checkpoint on: the whole stream at world 1).
TEST(Trainer, ResourcesSayWhatTheRankHoldsCheckpointBufferIncluded) {
  temp_dir d;
  auto r = run_training(tiny_vit_config({"train.max_steps=20", "checkpoint.every_steps=10", "train.log_every_steps=1"}), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  auto j = read_journal(d.path() + "/journal.jsonl");
  auto saved = events<ev::checkpoint_saved>(j);
  ASSERT_EQ(saved.size(), 2u);
  auto res = events<ev::resources>(j);
  ASSERT_FALSE(res.empty());
  const auto& rank = res.back().at("ranks").at(0);
  ASSERT_TRUE(rank.contains("param_bytes")) << rank.dump();
  EXPECT_EQ(rank.at("optimizer_state_bytes").get<uint64_t>(), 2 * rank.at("param_bytes").get<uint64_t>()) << rank.dump();
  EXPECT_EQ(rank.at("checkpoint_buffer_bytes").get<uint64_t>(), saved[0].at("bytes").get<uint64_t>()) << rank.dump();
}

// Train 2k steps straight, or k steps, stop, resume, k more: bitwise equal.
TEST(Trainer, ResumeIsExact) {
  temp_dir straight, interrupted;
  auto cfg = tiny_vit_config({"train.max_steps=16", "checkpoint.every_steps=4", "model.dropout=0.1"});
  auto a = run_training(cfg, quiet(straight.path()));
  ASSERT_TRUE(a) << a.message();
  auto opts = quiet(interrupted.path());
  opts.stop_at_step = 8;
  auto b1 = run_training(cfg, opts);
  ASSERT_TRUE(b1) << b1.message();
  EXPECT_FALSE(b1->finished);
  EXPECT_EQ(b1->step, 8);
  EXPECT_NE(b1->params_digest, a->params_digest);
  auto b2 = run_training(cfg, quiet(interrupted.path()));
  ASSERT_TRUE(b2) << b2.message();
  EXPECT_TRUE(b2->finished);
  EXPECT_EQ(b2->params_digest, a->params_digest);
  auto j = read_journal(interrupted.path() + "/journal.jsonl");
  auto restored = events<ev::checkpoint_restored>(j);
  ASSERT_EQ(restored.size(), 1u);
  EXPECT_EQ(restored[0].at("step"), 8);
  EXPECT_EQ(restored[0].at("source"), "disk");
}

// checkpoint.direct: the checkpoints at steps 4 and 8 are read from the
// state while steps 5 and 9 compute their gradients (their updates wait);
// the parts hold the bytes a buffered checkpoint holds, and the run ends
// where the buffered one does.
TEST(Trainer, DirectCheckpointsReadDuringTheNextStepHoldTheBufferedBytes) {
  temp_dir buffered, direct;
  const std::vector<std::string> base = {"train.max_steps=12", "checkpoint.every_steps=4", "model.dropout=0.1"};
  auto without = base;
  without.push_back("checkpoint.direct=false");
  auto a = run_training(tiny_vit_config(without), quiet(buffered.path()));
  ASSERT_TRUE(a) << a.message();
  auto with = base;
  with.push_back("checkpoint.direct=true");
  auto b = run_training(tiny_vit_config(with), quiet(direct.path()));
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(b->params_digest, a->params_digest);
  auto bytes = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  };
  for (const char* step : {"000000004", "000000008", "000000012"}) {
    const std::string name = std::string("/checkpoints/ckpt-") + step + ".g1.r0-of-1.part";
    const std::string x = bytes(buffered.path() + name), y = bytes(direct.path() + name);
    ASSERT_FALSE(x.empty()) << name;
    EXPECT_TRUE(x == y) << name << " differs between the buffered and the direct write";
  }
  for (const auto& [dir, want] : {std::make_pair(buffered.path(), 0), std::make_pair(direct.path(), 1)}) {
    auto saved = events<ev::checkpoint_saved>(read_journal(dir + "/journal.jsonl"));
    ASSERT_EQ(saved.size(), 3u);
    for (const auto& e : saved) EXPECT_EQ(e.at("direct_ranks").get<int>(), want) << e.dump();
  }
}

// The hook checkpoint.direct waits in: never during a step's forward and
// backward, once before the update, while the parameters are still the
// step's; and before whatever else changes or swaps them.
TEST(Trainer, TheBeforeUpdateHookRunsBeforeTheUpdateAndNotDuringForwardBackward) {
  auto cfg = tiny_vit_config({"train.max_steps=4"});
  auto created = training_state::create(cfg);
  ASSERT_TRUE(created) << created.message();
  training_state& s = *created.value();
  auto params = [&] {
    std::vector<torch::Tensor> out;
    for (auto& p : s.the_task().module()->parameters()) out.push_back(p.detach().clone());
    return out;
  };
  auto same = [](const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& y) {
    for (size_t i = 0; i < x.size(); ++i)
      if (!torch::equal(x[i], y[i])) return false;
    return x.size() == y.size();
  };
  const auto before = params();
  int calls = 0;
  bool unchanged_at_hook = false;
  s.set_before_update([&] {
    ++calls;
    unchanged_at_hook = same(params(), before);
  });
  s.forward_backward(s.order().global_batch(0), 0);
  EXPECT_EQ(calls, 0) << "forward and backward do not wait for a checkpoint write";
  s.apply_update();
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(unchanged_at_hook) << "the hook ran after the parameters changed";
  EXPECT_FALSE(same(params(), before)) << "the update changed nothing";
  (void)s.params_digest();
  EXPECT_EQ(calls, 2);
  ASSERT_TRUE(s.reset_state());
  EXPECT_GE(calls, 3);
  s.set_before_update(nullptr);
  s.apply_update();
}

// data.sample_log: one line per step, the step's global batch as
// data_order cuts it (micro-batches included), world 1; a resumed run writes
// a file of its own under a newer number. A directory that cannot be made
// is one line before anything starts.
TEST(Trainer, SampleLogRecordsEveryStepsBatch) {
  temp_dir d;
  const std::string dir = d.path() + "/samples";
  auto cfg = tiny_vit_config({"train.max_steps=12", "checkpoint.every_steps=4", "train.micro_batch_size=8", "data.sample_log=" + dir});
  auto opts = quiet(d.path());
  opts.stop_at_step = 8;
  ASSERT_TRUE(run_training(cfg, opts));
  ASSERT_TRUE(run_training(cfg, quiet(d.path())));
  auto reference = training_state::create(cfg);
  ASSERT_TRUE(reference) << reference.message();
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 2u);
  std::map<int64_t, uint64_t> generation_of;
  for (const auto& f : files) {
    std::ifstream in(f);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      int64_t step = 0;
      uint64_t gen = 0;
      int rank = -1, world = 0;
      std::string indices;
      fields >> step >> gen >> rank >> world >> indices;
      EXPECT_EQ(rank, 0) << line;
      EXPECT_EQ(world, 1) << line;
      std::string want;
      for (int64_t i : reference.value()->order().global_batch(step)) want += (want.empty() ? "" : ",") + std::to_string(i);
      EXPECT_EQ(indices, want) << "step " << step;
      EXPECT_EQ(generation_of.count(step), 0u) << "step " << step << " twice";
      generation_of[step] = gen;
    }
  }
  ASSERT_EQ(generation_of.size(), 12u);
  EXPECT_EQ(generation_of.begin()->first, 0);
  EXPECT_EQ(generation_of[0], 1u);
  EXPECT_EQ(generation_of[7], 1u);
  EXPECT_EQ(generation_of[8], 2u);
  EXPECT_EQ(generation_of[11], 2u);

  std::ofstream(d.path() + "/a-file") << "x";
  auto bad = run_training(tiny_vit_config({"data.sample_log=" + d.path() + "/a-file/samples"}), quiet(d.path() + "/other"));
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.message().rfind("data.sample_log: directory '" + d.path() + "/a-file/samples' is not writable", 0), 0u) << bad.message();
  EXPECT_EQ(bad.message().find('\n'), std::string::npos);
}

// A checkpoint store a cluster committed to (generation 3) takes dtactor
// train's checkpoints: they carry the store's newest generation (a
// generation 0 was refused by the store's fence, the final one included).
// DiLoCo in one process: after the line of each step an outer step lands
// at, a "synced" line (bench/check_sample_log.py --diloco counts the lines
// before it).
TEST(Trainer, DiLoCoSampleLogSaysWhereEachOuterStepLanded) {
  temp_dir d;
  const std::string dir = d.path() + "/samples";
  auto cfg = tiny_vit_config({"train.max_steps=10", "train.sync=diloco", "train.sync_every=4", "data.sample_log=" + dir});
  ASSERT_TRUE(run_training(cfg, quiet(d.path())));
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path().string());
  ASSERT_EQ(files.size(), 1u);
  std::ifstream in(files[0]);
  std::vector<std::string> kinds;  // "s<step>" for a step's line, "synced <step>"
  for (std::string line; std::getline(in, line);) {
    std::istringstream fields(line);
    int64_t step = 0;
    uint64_t gen = 0;
    int rank = -1, world = 0;
    std::string last;
    fields >> step >> gen >> rank >> world >> last;
    kinds.push_back(last == "synced" ? "synced " + std::to_string(step) : "s" + std::to_string(step));
  }
  const std::vector<std::string> want = {"s0", "s1", "s2", "s3", "synced 4", "s4", "s5", "s6", "s7", "synced 8", "s8", "s9", "synced 10"};
  EXPECT_EQ(kinds, want);
}

// A loss that becomes NaN or infinite ends the run with one line and a
// job_failed event (the rank worker's check: a cluster fails the same way).
TEST(Trainer, ALossThatBecomesNonFiniteEndsTheRunWithOneLine) {
  temp_dir d;
  auto r = run_training(tiny_vit_config({"train.max_steps=40", "train.lr=1e30", "train.warmup_steps=0", "train.grad_clip=0"}), quiet(d.path()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("loss became"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("lower train.lr"), std::string::npos) << r.message();
  EXPECT_EQ(r.message().find('\n'), std::string::npos);
  auto j = read_journal(d.path() + "/journal.jsonl");
  auto failed = events<ev::job_failed>(j);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_LT(failed[0].at("step").get<int64_t>(), 40);
  EXPECT_TRUE(events<ev::job_finished>(j).empty());
}

TEST(Trainer, CommitsIntoAStoreAClusterCommittedTo) {
  temp_dir d;
  auto opts = quiet(d.path());
  opts.stop_at_step = 4;
  ASSERT_TRUE(run_training(tiny_vit_config({"train.max_steps=8", "checkpoint.every_steps=4"}), opts));
  {
    auto store = checkpoint_store::open(d.path() + "/checkpoints", checkpoint_policy{});
    ASSERT_TRUE(store) << store.message();
    auto meta = store->read_manifest(manifest_name(4));
    ASSERT_TRUE(meta) << meta.message();
    meta->set_generation(3);
    ASSERT_TRUE(store->commit(meta.value()));
  }
  auto r = run_training(tiny_vit_config({"train.max_steps=8", "checkpoint.every_steps=4"}), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  EXPECT_TRUE(r->finished);
  auto store = checkpoint_store::open(d.path() + "/checkpoints", checkpoint_policy{});
  ASSERT_TRUE(store);
  auto last = store->read_manifest(manifest_name(8));
  ASSERT_TRUE(last) << last.message();
  // A run is one generation above every one the store holds: not fenced out.
  EXPECT_EQ(last->generation(), 4u);
}

TEST(Trainer, CorruptNewestCheckpointIsSkippedAndReported) {
  temp_dir d;
  auto cfg = tiny_vit_config({"train.max_steps=12", "checkpoint.every_steps=4", "checkpoint.keep_last=5"});
  auto opts = quiet(d.path());
  opts.stop_at_step = 8;
  ASSERT_TRUE(run_training(cfg, opts));
  // Truncate the newest checkpoint's part (step 8) as a crash mid-copy would.
  const std::string newest = d.path() + "/checkpoints/ckpt-000000008.manifest";
  // The first run in a store of its own is generation 1.
  const std::string part = d.path() + "/checkpoints/ckpt-000000008.g1.r0-of-1.part";
  ASSERT_TRUE(std::filesystem::exists(newest));
  ASSERT_TRUE(std::filesystem::exists(part));
  std::filesystem::resize_file(part, std::filesystem::file_size(part) / 2);
  auto r = run_training(cfg, quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  auto j = read_journal(d.path() + "/journal.jsonl");
  auto skipped = events<ev::checkpoint_skipped>(j);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_EQ(skipped[0].at("path"), newest);
  auto restored = events<ev::checkpoint_restored>(j);
  ASSERT_EQ(restored.size(), 1u);
  EXPECT_EQ(restored[0].at("step"), 4);
}

TEST(Trainer, RefusesACheckpointOfAnotherArchitecture) {
  temp_dir d;
  auto opts = quiet(d.path());
  ASSERT_TRUE(run_training(tiny_vit_config({"train.max_steps=2"}), opts));
  auto r = run_training(tiny_vit_config({"train.max_steps=4", "model.dim=32"}), opts);
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("different model.* settings"), std::string::npos) << r.message();
  r = run_training(tiny_vit_config({"train.max_steps=4", "train.global_batch_size=16"}), opts);
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("global_batch_size"), std::string::npos) << r.message();
}

TEST(Trainer, ImpossibleSettingsAreErrors) {
  temp_dir d;
  auto r = run_training(tiny_vit_config({"train.global_batch_size=100000"}), quiet(d.path()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("larger than the training set"), std::string::npos) << r.message();
  r = run_training(tiny_vit_config({"train.micro_batch_size=64"}), quiet(d.path()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("micro_batch_size"), std::string::npos) << r.message();
  r = run_training(tiny_vit_config({"model.heads=3"}), quiet(d.path()));
  ASSERT_FALSE(r);
  r = run_training(tiny_vit_config({"model.patch_size=5"}), quiet(d.path()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("patch_size"), std::string::npos) << r.message();
  // A regular file where the checkpoint directory should be.
  { std::ofstream(d.path() + "/blocker") << "x"; }
  r = run_training(tiny_vit_config({"checkpoint.dir=" + d.path() + "/blocker/ckpts"}), quiet(d.path()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("not writable"), std::string::npos) << r.message();
  EXPECT_FALSE(std::filesystem::exists(d.path() + "/journal.jsonl.tmp"));
}

// The gradient must not depend on how the global batch is split into
// micro-batches or over ranks (only float summation order may differ).
TEST(Trainer, GradientDoesNotDependOnTheSplit) {
  auto grads_for = [](const std::vector<std::string>& extra, int world) {
    auto cfg = tiny_vit_config(extra);
    auto st = training_state::create(cfg);
    if (!st) throw std::runtime_error(st.message());
    auto& s = *st.value();
    for (int r = 0; r < world; ++r) s.forward_backward(s.order().rank_slice(0, r, world), 0, 0);
    std::vector<torch::Tensor> g;
    for (auto& t : s.gradients()) g.push_back(t.clone());
    return g;
  };
  auto whole = grads_for({}, 1);
  auto micro = grads_for({"train.micro_batch_size=8"}, 1);
  auto two = grads_for({}, 2);
  auto three = grads_for({}, 3);
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_TRUE(torch::allclose(whole[i], micro[i], 1e-4, 1e-6)) << i;
    EXPECT_TRUE(torch::allclose(whole[i], two[i], 1e-4, 1e-6)) << i;
    EXPECT_TRUE(torch::allclose(whole[i], three[i], 1e-4, 1e-6)) << i;
  }
}

TEST(Trainer, Bf16AutocastTrains) {
  temp_dir d;
  auto r = run_training(tiny_vit_config({"train.bf16=true", "train.max_steps=30"}), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  auto steps = events<ev::step_completed>(read_journal(d.path() + "/journal.jsonl"));
  ASSERT_GE(steps.size(), 2u);
  EXPECT_LT(steps.back().at("loss_avg").get<double>(), steps.front().at("loss_avg").get<double>());
}

TEST(Trainer, EvalReadsTheNewestCheckpoint) {
  temp_dir d;
  auto r = run_training(tiny_vit_config({"train.max_steps=10"}), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  int64_t step = -1;
  auto e = run_evaluation(d.path(), "", {"eval.max_samples=500"}, &step);
  ASSERT_TRUE(e) << e.message();
  EXPECT_EQ(step, 10);
  EXPECT_NEAR(e->metrics.at("accuracy"), r->last_eval.metrics.at("accuracy"), 1e-12);
  auto missing = run_evaluation(d.path() + "/nope.dtc", "", {}, &step);
  ASSERT_FALSE(missing);
}

}  // namespace
}  // namespace dtactor
