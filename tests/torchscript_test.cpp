// model.name = torchscript: modules a PyTorch user scripted (written by
// Debian's python3-torch, tests/data/make_torchscript_fixtures.py) trained
// on .npy arrays NumPy wrote. Skipped, saying so, without python3-torch.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dtactor/task.hpp"
#include "model/trainer.hpp"
#include "rank/train_command.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::temp_dir;

// The fixtures, written once per test program.
const std::string& fixtures() {
  static std::string dir = [] {
    std::string d = (std::filesystem::temp_directory_path() / ("dtactor-ts-" + std::to_string(::getpid()))).string();
    return testing::write_torchscript_fixtures(d, DTACTOR_SOURCE_DIR) ? d : std::string();
  }();
  return dir;
}

#define NEED_FIXTURES()                                                                              \
  do {                                                                                               \
    if (fixtures().empty()) GTEST_SKIP() << "python3-torch (Debian) is not installed: no scripted modules to train"; \
  } while (0)

config ts_config(const std::string& module, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"model.name=torchscript",
                                "model.file=" + fixtures() + "/" + module,
                                "data.train_inputs=" + fixtures() + "/x_train.npy",
                                "data.train_targets=" + fixtures() + "/y_train.npy",
                                "data.eval_inputs=" + fixtures() + "/x_eval.npy",
                                "data.eval_targets=" + fixtures() + "/y_eval.npy",
                                "train.global_batch_size=64",
                                "train.max_steps=150",
                                "train.warmup_steps=10",
                                "train.lr=0.01",
                                "train.threads=1",
                                "eval.every_steps=0",
                                "checkpoint.every_steps=0",
                                "train.log_every_steps=50"};
  o.insert(o.end(), extra.begin(), extra.end());
  auto c = config::load("", o);
  if (!c) throw std::runtime_error(c.message());
  return c.value();
}

train_options quiet(const std::string& dir) {
  train_options t;
  t.run_dir = dir;
  t.interactive = false;
  return t;
}

TEST(TorchScript, AScriptedClassifierLearnsAndReportsAccuracyAndTop5) {
  NEED_FIXTURES();
  temp_dir d;
  auto r = run_training(ts_config("mlp.pt"), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  EXPECT_TRUE(r->finished);
  const auto& m = r->last_eval.metrics;
  ASSERT_TRUE(m.count("accuracy") && m.count("top5_accuracy") && m.count("val_loss"));
  EXPECT_GT(m.at("accuracy"), 0.6) << "10 classes: chance is 0.1";
  EXPECT_GE(m.at("top5_accuracy"), m.at("accuracy"));
}

TEST(TorchScript, AModuleWithItsOwnLossTrainsOnItAndReportsPerplexity) {
  NEED_FIXTURES();
  temp_dir d;
  auto r = run_training(ts_config("mlp_loss.pt", {"train.loss_is_nll=true", "train.max_steps=60"}), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  const auto& m = r->last_eval.metrics;
  ASSERT_TRUE(m.count("val_loss") && m.count("perplexity"));
  EXPECT_FALSE(m.count("accuracy")) << "the module's loss: no accuracy dtactor could compute";
  EXPECT_NEAR(m.at("perplexity"), std::exp(m.at("val_loss")), 1e-9);
  EXPECT_LT(m.at("val_loss"), std::log(10.0));
}

TEST(TorchScript, ResumeIsExactWithDropoutInsideTheScriptedModule) {
  NEED_FIXTURES();
  temp_dir straight, interrupted;
  auto cfg = ts_config("mlp.pt", {"train.max_steps=40", "checkpoint.every_steps=10"});
  auto a = run_training(cfg, quiet(straight.path()));
  ASSERT_TRUE(a) << a.message();
  auto opts = quiet(interrupted.path());
  opts.stop_at_step = 20;
  ASSERT_TRUE(run_training(cfg, opts));
  auto b = run_training(cfg, quiet(interrupted.path()));
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(a->params_digest, b->params_digest);
}

// train.bf16 reaches the ops inside a scripted module (LibTorch's CPU
// autocast works at the dispatcher, below the TorchScript interpreter): the
// run differs from the fp32 one, still learns, and resumes exactly.
TEST(TorchScript, Bf16AutocastAppliesInsideTheScriptedModule) {
  NEED_FIXTURES();
  temp_dir fp32, bf16, interrupted;
  auto a = run_training(ts_config("mlp.pt", {"train.max_steps=40"}), quiet(fp32.path()));
  ASSERT_TRUE(a) << a.message();
  auto cfg = ts_config("mlp.pt", {"train.max_steps=40", "train.bf16=true", "checkpoint.every_steps=10"});
  auto b = run_training(cfg, quiet(bf16.path()));
  ASSERT_TRUE(b) << b.message();
  EXPECT_NE(a->params_digest, b->params_digest) << "bf16 changed nothing: autocast did not reach the scripted ops";
  EXPECT_GT(b->last_eval.metrics.at("accuracy"), 0.5);
  EXPECT_NEAR(b->last_eval.metrics.at("accuracy"), a->last_eval.metrics.at("accuracy"), 0.1);
  auto opts = quiet(interrupted.path());
  opts.stop_at_step = 20;
  ASSERT_TRUE(run_training(cfg, opts));
  auto c = run_training(cfg, quiet(interrupted.path()));
  ASSERT_TRUE(c) << c.message();
  EXPECT_EQ(b->params_digest, c->params_digest);
}

TEST(TorchScript, ModulesAndDataThatDoNotFitAreOneClearLine) {
  NEED_FIXTURES();
  auto why = [](const config& c) {
    auto t = make_task(c);
    EXPECT_FALSE(t.ok());
    return t.ok() ? std::string() : t.message();
  };
  EXPECT_NE(why(ts_config("not_a_module.pt")).find("is not a TorchScript file torch::jit::load can read"), std::string::npos);
  EXPECT_NE(why(ts_config("missing.pt")).find("missing.pt' does not exist"), std::string::npos);
  const std::string shape = why(ts_config("bad_shape.pt"));
  EXPECT_NE(shape.find("does not fit the data: with train.loss = cross_entropy, forward must return [batch, classes] scores"), std::string::npos) << shape;
  EXPECT_NE(shape.find("got [2, 10, 2]"), std::string::npos) << shape;
  EXPECT_NE(why(ts_config("scalar_loss.pt")).find("must return one value per sample: a tensor of shape [2], got []"), std::string::npos)
      << why(ts_config("scalar_loss.pt"));
  const std::string shorter = why(ts_config("mlp.pt", {"data.train_targets=" + fixtures() + "/y_short.npy"}));
  EXPECT_NE(shorter.find("data.train_inputs has 1024 samples"), std::string::npos) << shorter;
  EXPECT_NE(shorter.find("data.train_targets 100"), std::string::npos) << shorter;
  EXPECT_NE(why(ts_config("mlp.pt", {"data.train_inputs=" + fixtures() + "/mlp.pt"})).find("data.train_inputs: "), std::string::npos);
  EXPECT_EQ(why(ts_config("mlp.pt", {"data.train_inputs="})), "data.train_inputs is not set (model.name = torchscript trains on .npy arrays: set data.train_inputs and data.train_targets)");
  for (const auto& line : {why(ts_config("bad_shape.pt")), why(ts_config("not_a_module.pt"))}) EXPECT_EQ(line.find('\n'), std::string::npos) << line;
}

TEST(TorchScript, ATokenStreamTrainsASequenceModelOnWindows) {
  NEED_FIXTURES();
  temp_dir d;
  auto cfg = ts_config("bigram.pt", {"data.train_inputs=", "data.train_targets=", "data.eval_inputs=", "data.eval_targets=",
                                     "data.train_tokens=" + fixtures() + "/tokens.bin", "model.context=16", "model.vocab_size=64",
                                     "data.val_fraction=0.1", "train.max_steps=120", "train.lr=0.05"});
  auto t = make_task(cfg);
  ASSERT_TRUE(t) << t.message();
  // 20,000 tokens: the last 2,000 held out (125 windows of 16 side by side), every start before them a training sample.
  EXPECT_EQ(t.value()->eval_size(), (2000 - 1) / 16);
  EXPECT_EQ(t.value()->train_size(), 18000 - 16);
  auto r = run_training(cfg, quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  EXPECT_GT(r->last_eval.metrics.at("accuracy"), 0.95) << "the next token of the pattern is a function of the current one";
  auto bad = make_task(ts_config("bigram.pt", {"data.train_tokens=" + fixtures() + "/tokens_bad.bin", "model.context=8", "model.vocab_size=64"}));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("data.train_tokens: "), std::string::npos) << bad.message();
  EXPECT_NE(bad.message().find("70"), std::string::npos) << bad.message();
}

// The same token stream cut into 8 shard files (docs/data.md): a glob or a
// {..} range names them; the last shard is held out; the order reads a block
// of shards at a time; the sequence model learns as from the one file.
TEST(TorchScript, ShardedTokenStreamsTrainFromAGlobOrARange) {
  NEED_FIXTURES();
  temp_dir d;
  std::ifstream in(fixtures() + "/tokens.bin", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(all.size(), 40000u);
  for (int k = 0; k < 8; ++k) {
    char name[32];
    std::snprintf(name, sizeof name, "/shard-%03d.bin", k);
    std::ofstream(d.path() + name, std::ios::binary) << all.substr(static_cast<size_t>(k) * 5000, 5000);
  }
  std::ofstream(d.path() + "/other.bin", std::ios::binary) << all.substr(0, 100);  // not matched
  for (const std::string& spec : std::vector<std::string>{d.path() + "/shard-*.bin", d.path() + "/shard-{000..007}.bin"}) {
    auto cfg = ts_config("bigram.pt", {"data.train_inputs=", "data.train_targets=", "data.eval_inputs=", "data.eval_targets=",
                                       "data.train_tokens=" + spec, "model.context=16", "model.vocab_size=64", "data.val_fraction=0.1",
                                       "data.shuffle_block_shards=2", "train.max_steps=120", "train.lr=0.05"});
    auto t = make_task(cfg);
    ASSERT_TRUE(t) << t.message();
    // 2,500 tokens a shard: 7 training shards of 2,484 windows, 1 held out of (2,500 - 1) / 16 windows.
    EXPECT_EQ(t.value()->train_size(), 7 * (2500 - 16)) << spec;
    EXPECT_EQ(t.value()->eval_size(), (2500 - 1) / 16) << spec;
    EXPECT_EQ(t.value()->train_shard_samples(), std::vector<int64_t>(7, 2500 - 16));
    auto r = run_training(cfg, quiet(d.path() + "/run-" + std::to_string(spec.size())));
    ASSERT_TRUE(r) << r.message();
    EXPECT_GT(r->last_eval.metrics.at("accuracy"), 0.95) << spec;
  }
  // A shard with an id outside the vocabulary: one line naming that shard.
  std::ifstream bad_in(fixtures() + "/tokens_bad.bin", std::ios::binary);
  std::string bad((std::istreambuf_iterator<char>(bad_in)), std::istreambuf_iterator<char>());
  std::filesystem::create_directories(d.path() + "/bad");
  std::ofstream(d.path() + "/bad/a.bin", std::ios::binary) << bad;
  std::ofstream(d.path() + "/bad/b.bin", std::ios::binary) << bad;
  auto broken = make_task(ts_config("bigram.pt", {"data.train_inputs=", "data.train_targets=", "data.eval_inputs=", "data.eval_targets=",
                                                  "data.train_tokens=" + d.path() + "/bad/*.bin", "model.context=8", "model.vocab_size=64"}));
  ASSERT_FALSE(broken);
  EXPECT_NE(broken.message().find("shard " + d.path() + "/bad/a.bin: token id 70"), std::string::npos) << broken.message();
  EXPECT_EQ(broken.message().find('\n'), std::string::npos) << broken.message();
  // A glob that matches nothing, and one shard without data.eval_tokens.
  auto none = make_task(ts_config("bigram.pt", {"data.train_inputs=", "data.train_targets=", "data.train_tokens=" + d.path() + "/nothing-*.bin",
                                                "model.context=16", "model.vocab_size=64"}));
  ASSERT_FALSE(none);
  EXPECT_EQ(none.message().rfind("data.train_tokens: ", 0), 0u) << none.message();
  auto one = make_task(ts_config("bigram.pt", {"data.train_inputs=", "data.train_targets=", "data.train_tokens=" + d.path() + "/shard-00[0].bin",
                                               "model.context=16", "model.vocab_size=64"}));
  ASSERT_FALSE(one);
  EXPECT_NE(one.message().find("names one shard: set data.eval_tokens"), std::string::npos) << one.message();
}

TEST(TorchScript, WithoutEvalFilesAFractionOfTheTrainingArraysIsHeldOut) {
  NEED_FIXTURES();
  auto t = make_task(ts_config("mlp.pt", {"data.eval_inputs=", "data.eval_targets=", "data.val_fraction=0.25"}));
  ASSERT_TRUE(t) << t.message();
  EXPECT_EQ(t.value()->train_size(), 768);
  EXPECT_EQ(t.value()->eval_size(), 256);
}

}  // namespace
}  // namespace dtactor

namespace dtactor {
namespace {

std::string run_python(const std::string& args) {
  const std::string cmd = "/usr/bin/python3.11 " + std::string(DTACTOR_SOURCE_DIR) + "/tests/data/check_export.py " + args + " 2>&1";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    char buf[4096];
    while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
    ::pclose(p);
  }
  return out;
}

TEST(TorchScript, ExportedModuleAndStateDictGiveDtactorsAccuracyInPyTorch) {
  NEED_FIXTURES();
  temp_dir d;
  auto r = run_training(ts_config("mlp.pt", {"train.max_steps=100", "checkpoint.every_steps=50"}), quiet(d.path()));
  ASSERT_TRUE(r) << r.message();
  const double ours = r->last_eval.metrics.at("accuracy");
  auto m = run_export(d.path(), d.path() + "/trained.pt", false);
  ASSERT_TRUE(m) << m.message();
  EXPECT_EQ(m->what, "scripted module");
  EXPECT_EQ(m->step, 100);
  const std::string acc = run_python("module " + d.path() + "/trained.pt " + fixtures());
  EXPECT_NEAR(std::strtod(acc.c_str(), nullptr), ours, 0.005) << acc;
  auto sd = run_export(d.path(), d.path() + "/state.pt", true);
  ASSERT_TRUE(sd) << sd.message();
  EXPECT_EQ(sd->what, "state_dict");
  const std::string acc2 = run_python("state_dict " + d.path() + "/state.pt " + fixtures());
  EXPECT_NEAR(std::strtod(acc2.c_str(), nullptr), ours, 0.005) << acc2;
  auto none = run_export(d.path() + "/nope", d.path() + "/x.pt", false);
  ASSERT_FALSE(none);
  EXPECT_NE(none.message().find("no such checkpoint"), std::string::npos);
}

}  // namespace
}  // namespace dtactor
