// Issue 29's "exactly once", end to end: a TorchScript job on token shards
// in a local directory, with data.sample_log on, through a node killed -9
// mid-run, a node joining, every process killed right after a checkpoint
// and a resume on three nodes from the checkpoint directory. Then the
// training processes' own records (bench/check_sample_log.py) must show
// every step's batch as data_order::global_batch cuts it, every index of
// the epoch trained exactly once, and the steps after the checkpoint redone.
// The same checker must flag the log once it is doctored (a doubled line, a
// missing index). Waits for journal events, never for fixed times.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cluster_harness.hpp"
#include "model/trainer.hpp"
#include "base/process.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::cluster;
using testing::json;

constexpr int kShards = 10;  // the last one held out (data.val_fraction 0.1)
constexpr int kContext = 16;
constexpr int kTokensPerShard = 1616;               // 1600 windows of 17 tokens each
constexpr int64_t kSamples = 9 * 1600;              // N: the training windows of 9 shards
constexpr int64_t kBatch = 8;                       // B
constexpr int64_t kEpochSteps = kSamples / kBatch;  // 1800
constexpr int kCrashAt = 1010;                      // nodes a and c die right after this step (checkpoints every 40)

std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> job(const std::string& d, int min_nodes) {
  return {"model.name=torchscript",
          "model.file=" + d + "/fx/bigram.pt",
          "data.train_tokens=" + d + "/data/train-*.bin",
          "model.context=" + std::to_string(kContext),
          "model.vocab_size=64",
          "data.val_fraction=0.1",
          "data.shuffle_block_shards=2",
          "data.sample_log=" + d + "/samples",
          "train.global_batch_size=" + std::to_string(kBatch),
          "train.max_steps=" + std::to_string(kEpochSteps),
          "train.lr=0.05",
          "train.warmup_steps=10",
          "train.log_every_steps=10",
          "train.threads=1",
          "eval.every_steps=0",
          "eval.max_samples=200",
          "checkpoint.every_steps=40",
          "cluster.digest_every_steps=50",
          "cluster.min_nodes=" + std::to_string(min_nodes),
          "cluster.floor_nodes=2"};
}

struct checked {
  int exit_code = -1;
  json summary;
  std::string output;
};

// bench/check_sample_log.py over `dir` (with data_order's batches).
checked run_checker(const std::string& dir, const std::string& expected, const std::string& out, bool diloco = false) {
  checked r;
  std::vector<std::string> args = {"/usr/bin/python3.11", std::string(DTACTOR_SOURCE_DIR) + "/bench/check_sample_log.py", dir, "--samples",
                                   std::to_string(kSamples), "--batch", std::to_string(kBatch), "--steps", std::to_string(kEpochSteps),
                                   "--expected", expected};
  if (diloco) args.push_back("--diloco");
  auto p = child_process::spawn(args, false, out);
  if (!p) return r;
  auto e = p->wait(120000);
  if (!e) return r;
  r.exit_code = e->exit_code;
  r.output = file_text(out);
  // The JSON is stdout's; anything else (a traceback) makes it unparseable.
  r.summary = json::parse(r.output, nullptr, false);
  return r;
}

// The sample log's lines, file by file (name -> lines with their newline).
std::vector<std::pair<std::string, std::vector<std::string>>> log_lines(const std::string& dir) {
  std::vector<std::pair<std::string, std::vector<std::string>>> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::vector<std::string> lines;
    std::istringstream in(file_text(e.path().string()));
    std::string l;
    while (std::getline(in, l)) lines.push_back(l + "\n");
    out.emplace_back(e.path().filename().string(), std::move(lines));
  }
  std::sort(out.begin(), out.end());
  return out;
}

void write_lines(const std::string& path, const std::vector<std::string>& lines) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  for (const auto& l : lines) f << l;
}

uint64_t max_generation(const std::vector<json>& j) {
  uint64_t g = 0;
  for (const auto& e : testing::journal_events<ev::generation_started>(j)) g = std::max(g, e.at("generation").get<uint64_t>());
  return g;
}

// The token shards in d/data and data_order's global batches in `expected`
// (one line per step), from the task the ranks build.
void write_shards_and_batches(const std::string& d, const std::string& expected, const std::vector<std::string>& settings) {
  const std::string tokens = file_text(d + "/fx/tokens.bin");
  ASSERT_GE(tokens.size(), static_cast<size_t>(kShards * kTokensPerShard * 2));
  std::filesystem::create_directories(d + "/data");
  for (int k = 0; k < kShards; ++k) {
    char name[32];
    std::snprintf(name, sizeof name, "/data/train-%03d.bin", k);
    std::ofstream(d + name, std::ios::binary) << tokens.substr(static_cast<size_t>(k) * kTokensPerShard * 2, kTokensPerShard * 2);
  }
  auto cfg = config::load("", settings);
  ASSERT_TRUE(cfg) << cfg.message();
  (void)cfg->set("train.threads", "1");
  auto state = training_state::create(cfg.value());
  ASSERT_TRUE(state) << state.message();
  ASSERT_TRUE(state.value()->order().sharded());
  ASSERT_EQ(state.value()->order().dataset_size(), kSamples);
  std::ofstream f(expected);
  for (int64_t t = 0; t < kEpochSteps; ++t) {
    f << t << '\t';
    const auto batch = state.value()->order().global_batch(t);
    for (size_t i = 0; i < batch.size(); ++i) f << (i ? "," : "") << batch[i];
    f << '\n';
  }
}

// Issue 30: a DiLoCo worker killed -9 mid-window. The survivors train the
// lost worker's slices of the window again before the next boundary
// (replay), so every index of the epoch is in an outer step once: the
// checker in its DiLoCo mode (a line counts once an outer step covers it;
// streaming: per fragment) finds no slice missing and none twice, and
// finds them missing once the survivors' replayed lines are taken out of a
// copy of the log.
void diloco_kill_mid_window(const std::vector<std::string>& sync_settings, bool streaming) {
  testing::temp_dir td;
  const std::string d = td.path();
  if (auto e = testing::write_torchscript_fixtures(d + "/fx", DTACTOR_SOURCE_DIR); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  auto settings = job(d, 3);
  for (std::string kv : sync_settings) {
    if (kv.find("FX/") != std::string::npos) kv.replace(kv.find("FX/"), 3, d + "/fx/");
    settings.push_back(kv);
  }
  const std::string expected = d + "/expected.tsv";
  write_shards_and_batches(d, expected, settings);
  if (::testing::Test::HasFatalFailure()) return;
  const std::string run_dir = d + "/run";
  std::filesystem::create_directories(run_dir);
  cluster c(run_dir, testing::set_flags(settings));
  ASSERT_EQ(c.start_coordinator(), "");
  ASSERT_EQ(c.start_node("a"), "");
  ASSERT_EQ(c.start_node("b"), "");
  // c crashes (kill -9 of its node and rank) once it holds step 25: its
  // slices of steps 20..24 of the window of anchor 20 go with it.
  ASSERT_EQ(c.start_node("c", {"--fail-at-step", "25", "--fail-mode", "crash"}), "");
  auto done = c.coord->wait(240000);
  ASSERT_TRUE(done) << c.logs();
  EXPECT_EQ(done->exit_code, 0) << c.logs();
  const auto j = c.journal();
  auto fin = testing::journal_events<ev::job_finished>(j);
  ASSERT_EQ(fin.size(), 1u) << c.logs();
  EXPECT_EQ(fin[0].at("step"), kEpochSteps);
  EXPECT_EQ(fin[0].at("world_size"), 2);
  auto rec = testing::journal_events<ev::recovery_done>(j);
  ASSERT_EQ(rec.size(), 1u) << c.logs();
  ASSERT_TRUE(rec[0].contains("replayed_slices")) << rec[0].dump();
  const int64_t replayed = rec[0].at("replayed_slices").get<int64_t>();
  // At least c's slices of 20..24 (it trained them; they went with it), at
  // most its slices of the whole window (streaming: since the older
  // fragment's anchor, 5 steps earlier).
  EXPECT_GE(replayed, 5) << rec[0].dump();
  EXPECT_LE(replayed, streaming ? 15 : 10) << rec[0].dump();
  EXPECT_EQ(rec[0].at("lost_steps"), 0) << rec[0].dump();

  auto ok = run_checker(d + "/samples", expected, d + "/check.json", true);
  ASSERT_FALSE(ok.summary.is_discarded()) << ok.output;
  EXPECT_EQ(ok.exit_code, 0) << ok.output << c.logs();
  const json& s = ok.summary;
  EXPECT_EQ(s.at("fragments"), streaming ? 2 : 1) << ok.output;
  EXPECT_EQ(s.at("steps_missing"), 0) << ok.output;
  EXPECT_EQ(s.at("epoch0_indices_seen_once"), kSamples) << ok.output;
  EXPECT_EQ(s.at("epoch0_indices_seen_more"), 0) << ok.output;
  EXPECT_EQ(s.at("slices_trained_twice"), 0) << ok.output;
  EXPECT_EQ(s.at("wrong_slices"), 0) << ok.output;
  // c's lines since its last outer step (20..24) count for nothing.
  if (!streaming) {
    EXPECT_EQ(s.at("lines_lost_with_worker").get<int64_t>(), 5) << ok.output;
  }
  EXPECT_GE(s.at("fragment_slices_lost_with_worker").get<int64_t>(), 5) << ok.output;

  // The survivors' replayed lines (c's slices, world 3, in their files)
  // taken out of a copy: the checker finds c's slices in no outer step.
  const auto files = log_lines(d + "/samples");
  int c_rank = -1;
  for (const auto& [name, ls] : files)
    if (name.rfind("samples-c-", 0) == 0 && !ls.empty()) c_rank = std::stoi(ls.front().substr(ls.front().find('\t', ls.front().find('\t') + 1) + 1));
  ASSERT_GE(c_rank, 0);
  const std::string copy = d + "/samples-without-replays";
  std::filesystem::create_directories(copy);
  int64_t removed = 0;
  for (const auto& [name, ls] : files) {
    std::vector<std::string> out;
    for (const auto& l : ls) {
      std::vector<std::string> f;
      std::istringstream in(l);
      for (std::string x; std::getline(in, x, '\t');) f.push_back(x);
      const bool replay = name.rfind("samples-c-", 0) != 0 && f.size() >= 5 && f[3] == "3" && f[2] == std::to_string(c_rank) && f[4].rfind("synced", 0) != 0;
      if (replay)
        ++removed;
      else
        out.push_back(l);
    }
    write_lines(copy + "/" + name, out);
  }
  EXPECT_EQ(removed, replayed);
  auto bad = run_checker(copy, expected, d + "/check-without-replays.json", true);
  ASSERT_FALSE(bad.summary.is_discarded()) << bad.output;
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("is in no outer step"), std::string::npos) << bad.output;
}

TEST(ExactlyOnce, DiLoCoSurvivorsTrainALostWorkersSlicesAgainAndEveryIndexIsInAnOuterStepOnce) {
  diloco_kill_mid_window({"train.sync=diloco", "train.sync_every=10"}, false);
}

// Streaming (2 fragments, each exchange overlapping the next inner step): a
// slice of a step before a fragment's anchor is in that fragment already,
// and is trained again for the other fragment only.
TEST(ExactlyOnce, StreamingDiLoCoSurvivorsTrainALostWorkersSlicesAgainForTheFragmentsThatLackThem) {
  diloco_kill_mid_window({"train.sync=diloco", "train.sync_every=10", "train.sync_fragments=2", "model.file=" + std::string("FX/bigram2.pt")}, true);
}

TEST(ExactlyOnce, EveryIndexOnceThroughAKillAJoinAndAResumeAtAnotherWorldSize) {
  testing::temp_dir td;
  const std::string d = td.path();
  if (auto e = testing::write_torchscript_fixtures(d + "/fx", DTACTOR_SOURCE_DIR); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  // The shards, and data_order's global batches, from the task the ranks build.
  const std::string expected = d + "/expected.tsv";
  write_shards_and_batches(d, expected, job(d, 2));
  if (HasFatalFailure()) return;

  const std::string run_dir = d + "/run";
  std::filesystem::create_directories(run_dir);
  int64_t join_step = -1;
  uint64_t first_run_generation = 0;
  {
    // Two nodes; b killed -9 mid-run; with a floor of two the job waits
    // until c joins; a and c die (kill -9 of node and rank) right after step
    // kCrashAt, ten steps after a checkpoint; then the coordinator too.
    cluster c(run_dir, testing::set_flags(job(d, 2)));
    const std::vector<std::string> crash = {"--fail-at-step", std::to_string(kCrashAt), "--fail-mode", "crash"};
    ASSERT_EQ(c.start_coordinator(), "");
    ASSERT_EQ(c.start_node("a", crash), "");
    ASSERT_EQ(c.start_node("b"), "");
    ASSERT_TRUE(c.wait_step(50, 2, 120)) << c.logs();
    c.signal_node("b", SIGKILL);
    ASSERT_TRUE(c.wait_for([](const std::vector<json>& j) { return !testing::journal_events<ev::job_waiting>(j).empty(); }, 60)) << c.logs();
    ASSERT_EQ(c.start_node("c", crash), "");
    ASSERT_TRUE(c.wait_for(
        [&](const std::vector<json>& j) {
          for (const auto& g : testing::journal_events<ev::generation_started>(j)) {
            const auto& nodes = g.at("nodes");
            if (std::find(nodes.begin(), nodes.end(), "c") != nodes.end()) join_step = g.at("start_step").get<int64_t>();
          }
          return join_step >= 0;
        },
        120))
        << c.logs();
    ASSERT_LT(join_step, kCrashAt) << "the job reached the crash step before the kill and the join: " << c.logs();
    // a dies by itself after step kCrashAt; c with it, or alone right after.
    ASSERT_TRUE(c.wait_for(
        [](const std::vector<json>& j) {
          std::set<std::string> lost;
          for (const auto& e : testing::journal_events<ev::node_lost>(j)) lost.insert(e.at("node").get<std::string>());
          return lost.count("a") > 0;
        },
        180))
        << c.logs();
    c.coord->signal(SIGKILL);
    ASSERT_TRUE(c.coord->wait(10000));
    for (const std::string id : {"a", "c"}) c.signal_node(id, SIGKILL);
    first_run_generation = max_generation(c.journal());
  }
  const size_t first_run_lines = testing::read_journal_lines(run_dir + "/journal.jsonl").size();

  // Resumed from the checkpoint directory on three nodes (a and c again, and
  // d), in the same run directory, to the end of the epoch.
  int64_t resumed_at = -1;
  {
    cluster c(run_dir, testing::set_flags(job(d, 3)));
    ASSERT_EQ(c.start({"a", "c", "d"}), "");
    auto done = c.coord->wait(240000);
    ASSERT_TRUE(done) << c.logs();
    EXPECT_EQ(done->exit_code, 0) << c.logs();
    auto all = c.journal();
    ASSERT_GT(all.size(), first_run_lines);
    const std::vector<json> j(all.begin() + static_cast<std::ptrdiff_t>(first_run_lines), all.end());
    auto fin = testing::journal_events<ev::job_finished>(j);
    ASSERT_EQ(fin.size(), 1u) << c.logs();
    EXPECT_EQ(fin[0].at("step"), kEpochSteps);
    EXPECT_EQ(fin[0].at("world_size"), 3);
    for (const auto& r : testing::journal_events<ev::checkpoint_restored>(j))
      if (r.at("source") == "disk") resumed_at = r.at("step").get<int64_t>();
    ASSERT_GT(resumed_at, join_step) << c.logs();
    ASSERT_LE(resumed_at, kCrashAt);
    // The resumed run's generations come after the first run's, and its
    // checkpoints commit (a generation numbered from 1 again was fenced out).
    for (const auto& g : testing::journal_events<ev::generation_started>(j))
      EXPECT_GT(g.at("generation").get<uint64_t>(), first_run_generation) << g.dump();
    EXPECT_TRUE(testing::journal_events<ev::checkpoint_failed>(j).empty()) << testing::journal_events<ev::checkpoint_failed>(j)[0].dump();
    auto saved = testing::journal_events<ev::checkpoint_saved>(j);
    ASSERT_FALSE(saved.empty()) << c.logs();
    EXPECT_EQ(saved.back().at("step"), kEpochSteps);
  }

  // What the processes recorded: every step as data_order cuts it, every
  // index of the epoch once, the steps after the checkpoint redone.
  auto ok = run_checker(d + "/samples", expected, d + "/check.json");
  ASSERT_FALSE(ok.summary.is_discarded()) << ok.output;
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  const json& s = ok.summary;
  EXPECT_TRUE(s.at("ok").get<bool>()) << ok.output;
  EXPECT_EQ(s.at("steps_missing"), 0) << ok.output;
  EXPECT_EQ(s.at("steps_redone").get<int64_t>(), kCrashAt - resumed_at) << ok.output;
  EXPECT_EQ(s.at("epoch0_indices_seen_once"), kSamples) << ok.output;
  EXPECT_EQ(s.at("epoch0_indices_seen_0"), 0) << ok.output;
  EXPECT_EQ(s.at("epoch0_indices_seen_more"), 0) << ok.output;
  EXPECT_EQ(s.at("doubled_lines"), 0) << ok.output;
  EXPECT_EQ(s.at("wrong_slices"), 0) << ok.output;
  std::set<int> worlds;
  for (const auto& [g, w] : s.at("world_sizes").items()) worlds.insert(w.get<int>());
  EXPECT_EQ(worlds, (std::set<int>{2, 3})) << ok.output;

  // The checker can fail: a line written twice, and a line short of one
  // index, each in a copy of the log.
  const auto files = log_lines(d + "/samples");
  ASSERT_FALSE(files.empty());
  // The last run's file with the most lines: its records are the ones that count.
  const auto& [busiest, lines] =
      *std::max_element(files.begin(), files.end(), [](const auto& a, const auto& b) { return a.second.size() < b.second.size(); });
  ASSERT_GT(lines.size(), 10u);
  for (const std::string doctoring : {"doubled", "short"}) {
    const std::string copy = d + "/samples-" + doctoring;
    std::filesystem::create_directories(copy);
    for (const auto& [name, ls] : files) {
      auto out = ls;
      if (name == busiest && doctoring == "doubled") out.push_back(ls[ls.size() / 2]);
      if (name == busiest && doctoring == "short") {
        std::string& l = out[ls.size() / 2];
        l = l.substr(0, l.rfind(',')) + "\n";
      }
      write_lines(copy + "/" + name, out);
    }
    auto bad = run_checker(copy, expected, d + "/check-" + doctoring + ".json");
    ASSERT_FALSE(bad.summary.is_discarded()) << bad.output;
    EXPECT_EQ(bad.exit_code, 1) << doctoring << ": " << bad.output;
    EXPECT_FALSE(bad.summary.at("ok").get<bool>()) << bad.output;
    if (doctoring == "doubled") {
      EXPECT_EQ(bad.summary.at("doubled_lines"), 1) << bad.output;
    } else {
      EXPECT_EQ(bad.summary.at("wrong_slices"), 1) << bad.output;
      EXPECT_EQ(bad.summary.at("epoch0_indices_seen_0"), 1) << bad.output;
    }
  }
}

}  // namespace
}  // namespace dtactor
