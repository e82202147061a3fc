// register_task (the C++ API's registry): a registered task's keys, files
// and main metric reach the config, the coordinator's checks and the
// training engine; bad registrations are refused with one line. Each test
// registers what it needs once (registrations are per process, and ctest
// runs each test in a process of its own, but `model_tests` alone runs
// them all in one).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "dtactor/task.hpp"
#include "app/train_command.hpp"
#include "data/data_shards.hpp"
#include "job/job_config.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::temp_dir;

// y = x . w for a fixed w, learned by a linear layer (mse).
class linear_task : public task {
 public:
  explicit linear_task(int64_t features) : lin_(torch::nn::Linear(features, 1)) {
    torch::Generator g = at::detail::createCPUGenerator(99);
    x_ = torch::randn({256, features}, g);
    y_ = x_.matmul(torch::arange(1, features + 1, torch::kFloat)).unsqueeze(1);
  }
  std::string name() const override { return "linreg"; }
  std::shared_ptr<torch::nn::Module> module() override { return lin_.ptr(); }
  int64_t train_size() const override { return 192; }
  int64_t eval_size() const override { return 64; }
  torch::Tensor loss_sum(const std::vector<int64_t>& idx) override {
    auto i = torch::tensor(idx, torch::kLong);
    return (lin_->forward(x_.index_select(0, i)) - y_.index_select(0, i)).pow(2).sum();
  }
  eval_result evaluate(int64_t, int64_t) override {
    auto d = lin_->forward(x_.slice(0, 192)) - y_.slice(0, 192);
    return {{{"val_loss", d.pow(2).mean().item<double>()}}, {}};
  }

 private:
  torch::nn::Linear lin_;
  torch::Tensor x_, y_;
};

task_registration linreg(std::string name = "linreg", std::string features = "model.features", std::string notes = "data.notes") {
  task_registration r;
  r.name = std::move(name);
  r.description = "a test";
  r.main_metric = "val_loss";
  r.keys = {{features, value_kind::integer, "4", "linreg: inputs.", 1, {}}, {notes, value_kind::string, "", "linreg: a file.", -1e300, {}}};
  r.file_keys = {notes};
  r.make = [features, notes](const config& cfg) -> result<std::unique_ptr<task>> {
    if (!cfg.get_string(notes).empty() && !std::filesystem::exists(cfg.get_string(notes)))
      return make_error(notes + ": no such file '" + cfg.get_string(notes) + "'");
    return std::unique_ptr<task>(new linear_task(cfg.get_int(features)));
  };
  return r;
}

void ensure_linreg() {
  static const bool done = register_task(linreg()).ok();
  ASSERT_TRUE(done);
}

TEST(TaskRegistry, KeysAndNameJoinTheConfig) {
  ensure_linreg();
  auto cfg = config::load("", {"model.name=linreg", "model.features=6"});
  ASSERT_TRUE(cfg) << cfg.message();
  EXPECT_EQ(cfg->get_int("model.features"), 6);
  EXPECT_EQ(cfg->get_string("data.notes"), "");
  // Its keys sit in their sections of the TOML, and a typo gets a suggestion.
  const std::string toml = cfg->to_toml();
  EXPECT_LT(toml.find("features = 6"), toml.find("[data]"));
  EXPECT_GT(toml.find("notes = ''"), toml.find("[data]"));
  auto typo = config::load("", {"model.featurs=3"});
  ASSERT_FALSE(typo);
  EXPECT_NE(typo.message().find("did you mean 'model.features'"), std::string::npos) << typo.message();
  // A model name nobody registered is still refused.
  EXPECT_FALSE(config::load("", {"model.name=linreg2"}));
  // The checkpoint policy ranks by the registered metric.
  EXPECT_EQ(main_metric_for("linreg"), "val_loss");
  // model.* keys are part of the architecture checked on resume.
  EXPECT_NE(cfg->digest({"model."}), config::load("", {"model.name=linreg"})->digest({"model."}));
}

TEST(TaskRegistry, FileKeysAreAbsoluteAndDigested) {
  ensure_linreg();
  temp_dir d;
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(d.path());
  { std::ofstream(d.path() + "/notes.txt") << "the same on every node\n"; }
  auto cfg = config::load("", {"model.name=linreg", "data.notes=notes.txt"});
  ASSERT_TRUE(cfg);
  absolutize_data_paths(cfg.value());
  std::filesystem::current_path(cwd);
  EXPECT_EQ(cfg->get_string("data.notes"), d.path() + "/notes.txt");
  auto digests = data_file_digests(cfg.value());
  ASSERT_EQ(digests.size(), 1u);
  EXPECT_EQ(digests.begin()->first, d.path() + "/notes.txt");
  EXPECT_EQ(digests.begin()->second.rfind("23:", 0), 0u) << digests.begin()->second;
  std::vector<std::string> missing;
  (void)cfg->set("data.notes", d.path() + "/gone.txt");
  EXPECT_TRUE(data_file_digests(cfg.value(), &missing).empty());
  EXPECT_EQ(missing, std::vector<std::string>{d.path() + "/gone.txt"});
}

// A file key may hold a shard spec (dtactor/shards.hpp): each local item of
// it is made absolute where dtactor starts, and every node's digest of the
// whole set (names, sizes, index digests) must equal the coordinator's.
TEST(TaskRegistry, AFileKeyHoldingAShardSpecIsMadeAbsoluteAndDigestedAsASet) {
  ensure_linreg();
  temp_dir d;
  std::filesystem::create_directories(d.path() + "/shards");
  for (int k = 0; k < 3; ++k) std::ofstream(d.path() + "/shards/p-" + std::to_string(k) + ".csv") << "1,2\n" << k << ",4\n";
  { std::ofstream(d.path() + "/notes.txt") << "more\n"; }
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(d.path());
  auto cfg = config::load("", {"model.name=linreg", "data.notes=shards/p-*.csv, notes.txt"});
  ASSERT_TRUE(cfg) << cfg.message();
  absolutize_data_paths(cfg.value());
  auto remote = config::load("", {"model.name=linreg", "data.notes=s3://bucket/p-{0..2}.csv,shards/p-{0..1}.csv"});
  ASSERT_TRUE(remote) << remote.message();
  absolutize_data_paths(remote.value());
  std::filesystem::current_path(cwd);
  const std::string spec = d.path() + "/shards/p-*.csv," + d.path() + "/notes.txt";
  EXPECT_EQ(cfg->get_string("data.notes"), spec);
  EXPECT_EQ(remote->get_string("data.notes"), "s3://bucket/p-{0..2}.csv," + d.path() + "/shards/p-{0..1}.csv");

  auto digests = data_file_digests(cfg.value());
  ASSERT_EQ(digests.size(), 1u);
  EXPECT_EQ(digests.begin()->first, spec);
  auto shards = resolve_shards(spec);
  ASSERT_TRUE(shards) << shards.message();
  EXPECT_EQ(digests.begin()->second, shard_set_digest(shards.value()));
  EXPECT_EQ(digests.begin()->second.rfind("4x29:", 0), 0u) << digests.begin()->second;  // 3 x 8 bytes + 5
  // A node whose shards differ (in size; in bytes once indexed: docs/data.md)
  // reports another digest, and is refused.
  { std::ofstream(d.path() + "/shards/p-1.csv") << "1,2\n1,50\n"; }
  EXPECT_NE(data_file_digests(cfg.value()).begin()->second, digests.begin()->second);
  { std::ofstream(d.path() + "/shards/p-3.csv") << "3,3\n"; }
  EXPECT_EQ(data_file_digests(cfg.value()).begin()->second.rfind("5x", 0), 0u);
  // A spec that names nothing here is missing, as a missing file is.
  (void)cfg->set("data.notes", d.path() + "/shards/q-*.csv");
  std::vector<std::string> missing;
  EXPECT_TRUE(data_file_digests(cfg.value(), &missing).empty());
  EXPECT_EQ(missing, std::vector<std::string>{d.path() + "/shards/q-*.csv"});
}

TEST(TaskRegistry, TheEngineTrainsARegisteredTask) {
  ensure_linreg();
  temp_dir d;
  auto cfg = config::load("", {"model.name=linreg", "train.max_steps=150", "train.global_batch_size=32", "train.lr=0.05", "train.warmup_steps=5",
                               "train.weight_decay=0", "eval.every_steps=0", "checkpoint.every_steps=0"});
  ASSERT_TRUE(cfg) << cfg.message();
  train_options o;
  o.run_dir = d.path();
  o.interactive = false;
  auto r = run_training(cfg.value(), o);
  ASSERT_TRUE(r) << r.message();
  EXPECT_TRUE(r->finished);
  const double before = linear_task(4).evaluate(0, 0).metrics.at("val_loss");
  EXPECT_LT(r->last_eval.metrics.at("val_loss"), 0.01 * before) << "from " << before;
  // Errors of the factory come back as its line.
  (void)cfg->set("data.notes", "/nonexistent/notes.txt");
  auto bad = run_training(cfg.value(), o);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("data.notes: no such file '/nonexistent/notes.txt'"), std::string::npos) << bad.message();
}

TEST(TaskRegistry, BadRegistrationsAreRefusedWithOneLine) {
  auto bad = [](std::string name = "badreg") { return linreg(std::move(name), "model.bad_features", "data.bad_notes"); };
  auto refused = [](task_registration r, const std::string& why) {
    auto st = register_task(std::move(r));
    ASSERT_FALSE(st) << why;
    EXPECT_NE(st.message().find(why), std::string::npos) << st.message();
    EXPECT_EQ(st.message().find('\n'), std::string::npos);
  };
  refused(bad("Lin Reg"), "lower-case letters");
  refused(bad("vit"), "'vit' is a built-in model");
  auto r = bad();
  r.make = nullptr;
  refused(r, "factory");
  r = bad();
  r.keys.push_back({"train.mine", value_kind::integer, "1", "", 0, {}});
  refused(r, "'train.mine' must be under model. or data.");
  r = bad();
  r.keys.push_back({"model.dim", value_kind::integer, "1", "", 0, {}});
  refused(r, "'model.dim' already exists");
  r = bad();
  r.keys.push_back(r.keys[0]);
  refused(r, "declared twice");
  r = bad();
  r.keys[0].default_value = "four";
  refused(r, "must be an integer, got 'four'");
  r = bad();
  r.keys[0].default_value = "0";
  refused(r, "below its minimum");
  r = bad();
  r.file_keys = {"model.bad_features"};
  refused(r, "must be a string key");
  r = bad();
  r.file_keys = {"data.nowhere"};
  refused(r, "'data.nowhere' is not a config key");
  r = bad();
  r.main_metric = "";
  refused(r, "main_metric is empty");
  // Nothing of the refused ones stuck; the good one registers once.
  EXPECT_FALSE(config::load("", {"model.bad_features=2"}));
  EXPECT_FALSE(config::load("", {"model.name=badreg"}));
  ASSERT_TRUE(register_task(bad()));
  EXPECT_TRUE(config::load("", {"model.name=badreg", "model.bad_features=2"}));
  refused(bad(), "already registered");
}

}  // namespace
}  // namespace dtactor
