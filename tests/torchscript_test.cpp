// model.name = torchscript: modules a PyTorch user scripted (written by
// Debian's python3-torch, tests/data/make_torchscript_fixtures.py) trained
// on .npy arrays NumPy wrote. Skipped, saying so, without python3-torch.
#include <gtest/gtest.h>
#include <torch/script.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "dtactor/param_gate.hpp"
#include "dtactor/task.hpp"
#include "data/data_shards.hpp"
#include "model/layers.hpp"
#include "model/trainer.hpp"
#include "rank/state_io.hpp"
#include "app/train_command.hpp"
#include "storage/checkpoint_store.hpp"
#include "test_util.hpp"
#include "torchscript_fixtures.hpp"
#include "train_util.hpp"

namespace dtactor {
namespace {

using testing::quiet;
using testing::temp_dir;

const testing::torchscript_fixture_dir& fixture_files() { return testing::torchscript_fixtures(DTACTOR_SOURCE_DIR); }
const std::string& fixtures() { return fixture_files().dir; }

#define NEED_FIXTURES()                                                                         \
  do {                                                                                          \
    if (!fixture_files().error.empty()) SKIP_OR_FAIL_IN_CI(fixture_files().error);              \
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

// `cfg` trained straight through, and stopped at step 20 and resumed from
// its checkpoint: both runs' results, or the first failure.
struct straight_and_resumed {
  result<train_summary> straight = make_error("not run"), resumed = make_error("not run");
};
straight_and_resumed train_straight_and_resumed(const config& cfg) {
  temp_dir straight, interrupted;
  straight_and_resumed out;
  out.straight = run_training(cfg, quiet(straight.path()));
  auto opts = quiet(interrupted.path());
  opts.stop_at_step = 20;
  if (auto stopped = run_training(cfg, opts); !stopped) {
    out.resumed = stopped.err();
    return out;
  }
  out.resumed = run_training(cfg, quiet(interrupted.path()));
  return out;
}

TEST(TorchScript, ResumeIsExactWithDropoutInsideTheScriptedModule) {
  NEED_FIXTURES();
  auto r = train_straight_and_resumed(ts_config("mlp.pt", {"train.max_steps=40", "checkpoint.every_steps=10"}));
  ASSERT_TRUE(r.straight) << r.straight.message();
  ASSERT_TRUE(r.resumed) << r.resumed.message();
  EXPECT_EQ(r.straight->params_digest, r.resumed->params_digest);
}

// train.bf16 reaches the ops inside a scripted module (LibTorch's CPU
// autocast works at the dispatcher, below the TorchScript interpreter): the
// run differs from the fp32 one, still learns, and resumes exactly.
// train.sync = diloco on a scripted module (a world of one: the outer step
// takes its own pseudo-gradient): it learns, its checkpoints carry the
// outer state, and a resume from a boundary is exact.
TEST(TorchScript, DiLoCoTrainsAScriptedModuleAndResumesExactly) {
  NEED_FIXTURES();
  auto r = train_straight_and_resumed(
      ts_config("mlp.pt", {"train.max_steps=40", "checkpoint.every_steps=10", "train.sync=diloco", "train.sync_every=10"}));
  ASSERT_TRUE(r.straight) << r.straight.message();
  ASSERT_TRUE(r.resumed) << r.resumed.message();
  const auto& a = r.straight;
  EXPECT_GT(a->last_eval.metrics.at("accuracy"), 0.3) << "10 classes: chance is 0.1";
  EXPECT_EQ(a->params_digest, r.resumed->params_digest);
  // Not the synchronous job's parameters.
  auto plain = run_training(ts_config("mlp.pt", {"train.max_steps=40"}), quiet(temp_dir().path()));
  ASSERT_TRUE(plain) << plain.message();
  EXPECT_NE(plain->params_digest, a->params_digest);
}

// Streaming DiLoCo on a scripted module (two fragments, each exchange
// landing a step after it left): the checkpoint due at step 10 and the stop
// at step 20 fall while fragment 1's exchange is in flight, so both wait
// for it to land (step 11, step 21), and the resume is exact.
TEST(TorchScript, StreamingDiLoCoWaitsForTheFlightAndResumesExactly) {
  NEED_FIXTURES();
  auto cfg = ts_config("mlp.pt", {"train.max_steps=40", "checkpoint.every_steps=10", "train.sync=diloco", "train.sync_every=10", "train.sync_fragments=2"});
  auto r = train_straight_and_resumed(cfg);
  ASSERT_TRUE(r.straight) << r.straight.message();
  ASSERT_TRUE(r.resumed) << r.resumed.message();
  EXPECT_GT(r.straight->last_eval.metrics.at("accuracy"), 0.3) << "10 classes: chance is 0.1";
  EXPECT_EQ(r.straight->params_digest, r.resumed->params_digest);
  // The stop waited for the landing.
  temp_dir d;
  auto opts = quiet(d.path());
  opts.stop_at_step = 20;
  auto stopped = run_training(cfg, opts);
  ASSERT_TRUE(stopped) << stopped.message();
  EXPECT_EQ(stopped->step, 21);
  // Its export is the global model, not rank 0's own parameters (which
  // differ from it mid-run).
  auto sd = run_export(d.path(), d.path() + "/state.pt", true);
  ASSERT_TRUE(sd) << sd.message();
  EXPECT_EQ(sd->step, 21);
  std::ifstream in(d.path() + "/state.pt", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  auto ckpt = open_checkpoint_target(d.path(), {});
  ASSERT_TRUE(ckpt) << ckpt.message();
  auto state = training_state::create(cfg);
  ASSERT_TRUE(state) << state.message();
  ASSERT_TRUE(load_checkpoint(*state.value(), *ckpt->store, ckpt->meta).ok());
  auto module = state.value()->the_task().module();
  bool own_differs = false;
  for (const auto& kv : module->named_parameters()) own_differs = own_differs || !torch::equal(dict.at(kv.key()).toTensor(), kv.value());
  EXPECT_TRUE(own_differs) << "the export is rank 0's own parameters";
  state.value()->outer().swap_global();
  for (const auto& kv : module->named_parameters()) EXPECT_TRUE(torch::equal(dict.at(kv.key()).toTensor(), kv.value())) << kv.key();
  // Not plain DiLoCo's parameters.
  auto plain = run_training(ts_config("mlp.pt", {"train.max_steps=40", "train.sync=diloco", "train.sync_every=10"}), quiet(temp_dir().path()));
  ASSERT_TRUE(plain) << plain.message();
  EXPECT_NE(plain->params_digest, r.straight->params_digest);
}

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

// train.precision = bf16 on a scripted module: its parameters become bf16
// (the inputs are cast to them), it learns as in fp32, and its export,
// scripted again, holds the fp32 masters.
TEST(TorchScript, Bf16PrecisionTrainsTheScriptedModuleAndExportsItInFp32) {
  NEED_FIXTURES();
  temp_dir fp32, bf16;
  auto a = run_training(ts_config("mlp.pt", {"train.max_steps=40"}), quiet(fp32.path()));
  ASSERT_TRUE(a) << a.message();
  auto b = run_training(ts_config("mlp.pt", {"train.max_steps=40", "train.precision=bf16"}), quiet(bf16.path()));
  ASSERT_TRUE(b) << b.message();
  EXPECT_NE(a->params_digest, b->params_digest);
  EXPECT_GT(b->last_eval.metrics.at("accuracy"), 0.5);
  EXPECT_NEAR(b->last_eval.metrics.at("accuracy"), a->last_eval.metrics.at("accuracy"), 0.1);
  auto sd = run_export(bf16.path(), bf16.path() + "/module.pt", false);
  ASSERT_TRUE(sd) << sd.message();
  auto m = torch::jit::load(bf16.path() + "/module.pt");
  int params = 0;
  for (const auto& p : m.parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat);
    ++params;
  }
  EXPECT_GT(params, 0);
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

// A module that is no Sequential declares its units (dtactor_units: a
// LayerNorm, two entries of a ModuleList, the head): they are the task's
// units, in the order its forward calls them, whatever it does around
// them (a residual; two inputs summed, units inside a container, a loss
// method calling forward). A declaration that names what is not there or
// a unit inside another, a forward reading a unit's parameter outside the
// unit's call, or a declared unit it never calls is one clear line.
TEST(TorchScript, DeclaredUnitsAreTheTasksAndAWrongDeclarationIsOneClearLine) {
  NEED_FIXTURES();
  auto names_of = [](const std::string& module) {
    auto t = make_task(ts_config(module));
    EXPECT_TRUE(t.ok()) << t.message();
    std::vector<std::string> names;
    if (t.ok())
      for (const auto& u : t.value()->param_units()) names.push_back(u.name);
    return names;
  };
  EXPECT_EQ(names_of("declared.pt"), (std::vector<std::string>{"norm", "blocks.0", "blocks.1", "head"}));
  EXPECT_EQ(names_of("declared_residual.pt"), (std::vector<std::string>{"norm", "blocks.0", "blocks.1", "head"}));
  EXPECT_EQ(names_of("declared_deep.pt"), (std::vector<std::string>{"trunk.blocks.0", "trunk.blocks.1", "trunk.blocks.2", "head"}));
  EXPECT_EQ(names_of("declared_tuple.pt"), (std::vector<std::string>{"blocks.0", "blocks.1", "head"}));
  auto plain = make_task(ts_config("mlp.pt"));
  ASSERT_TRUE(plain.ok()) << plain.message();
  EXPECT_TRUE(plain.value()->param_units().empty());
  auto why = [](const std::string& module) {
    auto bad = make_task(ts_config(module));
    EXPECT_FALSE(bad.ok()) << module;
    return bad.ok() ? std::string() : bad.message();
  };
  EXPECT_NE(why("declared_missing.pt").find("declared_missing.pt': dtactor_units names 'blocks.9', which is no submodule of the module"), std::string::npos)
      << why("declared_missing.pt");
  EXPECT_NE(why("declared_nested.pt").find("dtactor_units names 'blocks.0' and 'blocks.0.0': a unit is named once and lies in no other"), std::string::npos)
      << why("declared_nested.pt");
  EXPECT_NE(why("declared_reads.pt").find("declared_reads.pt': its forward: it reads 'norm.weight' of the unit 'norm' outside the unit's own calls"),
            std::string::npos)
      << why("declared_reads.pt");
  EXPECT_NE(why("declared_unused.pt").find("declared_unused.pt': its forward never calls the unit 'unused'"), std::string::npos) << why("declared_unused.pt");
  for (const auto* m : {"declared_missing.pt", "declared_nested.pt", "declared_reads.pt", "declared_unused.pt"}) EXPECT_EQ(why(m).find('\n'), std::string::npos) << m;
}

// The module's forward (and loss) with its units' calls gated is its
// forward: on the first held-out samples, in evaluation mode, the mean loss
// PyTorch computed from the saved module (gated_expected.json).
TEST(TorchScript, AModuleWithUnitsComputesWhatPyTorchComputes) {
  NEED_FIXTURES();
  std::ifstream in(fixtures() + "/gated_expected.json");
  const auto expected = nlohmann::json::parse(in);
  for (const char* module : {"declared_residual.pt", "declared_deep.pt", "declared_tuple.pt", "seq.pt"}) {
    SCOPED_TRACE(module);
    auto t = make_task(ts_config(module));
    ASSERT_TRUE(t.ok()) << t.message();
    ASSERT_FALSE(t.value()->param_units().empty());
    t.value()->module()->eval();
    const double ours = t.value()->evaluate(8, 8).metrics.at("val_loss");
    EXPECT_NEAR(ours, expected.at(module).get<double>(), 1e-6);
  }
}

// A gate recording the calls a forward makes.
struct recording_gate : param_gate {
  std::vector<std::string> calls;
  void before_forward(int unit) override { calls.push_back("gather " + std::to_string(unit)); }
  void after_forward(int unit) override { calls.push_back("release " + std::to_string(unit)); }
  void before_backward(int unit) override { calls.push_back("gather again " + std::to_string(unit)); }
  void after_backward(int unit) override { calls.push_back("release again " + std::to_string(unit)); }
};

// An .npy file of float32 zeros, rows x cols.
void write_zeros_npy(const std::string& path, int rows, int cols) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " + std::to_string(cols) + "), }";
  header.append(64 - (10 + header.size() + 1) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out << "\x93NUMPY" << '\x01' << '\x00';
  out.put(static_cast<char>(header.size() & 0xff)).put(static_cast<char>(header.size() >> 8));
  out << header << std::string(static_cast<size_t>(rows) * cols * 4, '\0');
}

// A unit whose call throws (held-out inputs one feature wider than its
// LayerNorm) is released as it would be after its call, as gated()
// releases a C++ unit: nothing stays gathered for the next forward.
TEST(TorchScript, AUnitWhoseCallThrowsIsReleased) {
  NEED_FIXTURES();
  temp_dir d;
  write_zeros_npy(d.path() + "/wide.npy", 256, 21);
  auto t = make_task(ts_config("declared_residual.pt", {"data.eval_inputs=" + d.path() + "/wide.npy"}));
  ASSERT_TRUE(t.ok()) << t.message();
  auto gate = std::make_shared<recording_gate>();
  auto units = t.value()->param_units();
  ASSERT_EQ(units.size(), 4u);
  for (size_t i = 0; i < units.size(); ++i) {
    units[i].slot->gate = gate;
    units[i].slot->unit = static_cast<int>(i);
  }
  t.value()->module()->eval();
  EXPECT_ANY_THROW((void)t.value()->evaluate(8, 8));
  EXPECT_EQ(gate->calls, (std::vector<std::string>{"gather 0", "release 0"}));
  for (auto& u : units) u.slot->gate.reset();
}

// Resident kB of this process's mappings of `file` (/proc/self/smaps).
int64_t file_mapping_rss_kb(const std::string& file) {
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool inside = false;
  int64_t total = 0;
  const std::string path = std::filesystem::canonical(file).string();
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {  // a mapping's first line
      inside = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
      continue;
    }
    long kb = 0;
    if (inside && std::sscanf(line.c_str(), "Rss: %ld kB", &kb) == 1) total += kb;
  }
  return total;
}

// The file the mapping holding `p` maps ("" for anonymous memory).
std::string mapped_file_of(const void* p) {
  std::ifstream in("/proc/self/maps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(p);
  while (std::getline(in, line)) {
    unsigned long lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) != 2 || at < lo || at >= hi) continue;
    const auto slash = line.find('/');
    return slash == std::string::npos ? "" : line.substr(slash);
  }
  return "";
}

// Built deferred (train.zero = 3: a rank worker builds its model under
// defer_block_values), a module is loaded without reading its values: the
// 33.6 MB of its units' parameters keep no values and stay unread in the
// file's mapping (each rank later makes its own shards' from `initial`),
// and what `initial` gives is the file's. (The peak a load adds depends on
// the heap's history in a process running other tests, so it is not
// compared here: run alone, 5.5 MB built deferred against 33 MB whole.)
TEST(TorchScript, BuiltDeferredAModuleReadsNoValueOfItsUnitsWhileItLoads) {
  NEED_FIXTURES();
  const std::string file = fixtures() + "/big_units.pt";
  auto make = [](const std::string& module, bool deferred) {
    defer_block_values defer(deferred);
    auto made = make_task(ts_config(module));
    EXPECT_TRUE(made.ok()) << made.message();
    return made.ok() ? std::move(made.value()) : std::unique_ptr<task>();
  };
  std::unique_ptr<task> t = make("big_units.pt", true), whole_task = make("big_units.pt", false);
  ASSERT_TRUE(t);
  ASSERT_TRUE(whole_task);
  auto units = t->param_units();
  ASSERT_EQ(units.size(), 10u);
  ASSERT_TRUE(static_cast<bool>(units[1].initial));
  EXPECT_LT(file_mapping_rss_kb(file), 1024) << "values of the file were read through its mapping while it loaded";
  auto whole = torch::jit::load(file);
  std::map<std::string, torch::Tensor> in_file;
  for (const auto& p : whole.named_parameters(true)) in_file[p.name] = p.value;
  for (const auto& u : units) {
    SCOPED_TRACE(u.name);
    ASSERT_TRUE(static_cast<bool>(u.initial));
    for (const auto& p : u.params) EXPECT_TRUE(awaits_initial_values(p));
    const auto values = u.initial();
    ASSERT_EQ(values.size(), 2u);
    EXPECT_TRUE(torch::equal(values[0], in_file.at(u.name + ".weight")));
    EXPECT_TRUE(torch::equal(values[1], in_file.at(u.name + ".bias")));
  }
  // Read again from the file, not through the mapping (a page of it
  // truncated away would be a SIGBUS): the mapping still holds none.
  EXPECT_LT(file_mapping_rss_kb(file), 1024) << "initial read the units' values through the file's mapping";
  // Loaded whole, no unit awaits its values.
  for (const auto& u : whole_task->param_units()) EXPECT_FALSE(static_cast<bool>(u.initial)) << u.name;
  // Buffers (a BatchNorm's running statistics, written in training) are
  // copied out of the file at once, with the file's values; the trained
  // parameters still read it until the optimizer takes them in.
  std::unique_ptr<task> bn;
  {
    defer_block_values defer(true);
    auto made = make_task(ts_config("bn.pt"));
    ASSERT_TRUE(made.ok()) << made.message();
    bn = std::move(made.value());
  }
  auto bn_file = torch::jit::load(fixtures() + "/bn.pt");
  std::map<std::string, torch::Tensor> buffers_in_file;
  for (const auto& b : bn_file.named_buffers(true)) buffers_in_file[b.name] = b.value;
  const auto buffers = bn->module()->named_buffers(true);
  ASSERT_EQ(buffers.size(), 3u);
  for (const auto& b : buffers) {
    SCOPED_TRACE(b.key());
    EXPECT_EQ(mapped_file_of(b.value().data_ptr()), "");
    EXPECT_TRUE(torch::equal(b.value(), buffers_in_file.at(b.key())));
  }
  EXPECT_NE(mapped_file_of(bn->module()->parameters()[0].data_ptr()).find("bn.pt"), std::string::npos);
}

// A unit's values are read again from the file when a rank makes its
// shards (`initial`, at the job's first step, maybe minutes after the
// load): a file replaced by a rename meanwhile still gives the loaded
// file's values (it stays open), and one written into in place (a
// re-export over it, a cp) is one line of error, never values of two files
// mixed or a SIGBUS from a page truncated away.
TEST(TorchScript, AUnitsValuesReadAfterTheLoadAreTheLoadedFilesOrOneLineOfError) {
  NEED_FIXTURES();
  temp_dir d;
  const std::string file = d.path() + "/model.pt";
  auto build = [&] {
    std::filesystem::copy_file(fixtures() + "/big_units.pt", file, std::filesystem::copy_options::overwrite_existing);
    defer_block_values defer(true);
    auto made = make_task(ts_config("big_units.pt", {"model.file=" + file}));
    EXPECT_TRUE(made.ok()) << made.message();
    return made.ok() ? std::move(made.value()) : std::unique_ptr<task>();
  };
  auto whole = torch::jit::load(fixtures() + "/big_units.pt");
  std::map<std::string, torch::Tensor> in_file;
  for (const auto& p : whole.named_parameters(true)) in_file[p.name] = p.value;
  {
    auto t = build();
    ASSERT_TRUE(t);
    const auto units = t->param_units();
    ASSERT_EQ(units.size(), 10u);
    // Another module renamed over it.
    std::filesystem::copy_file(fixtures() + "/mlp.pt", d.path() + "/other.pt");
    std::filesystem::rename(d.path() + "/other.pt", file);
    const auto values = units[3].initial();
    ASSERT_EQ(values.size(), 2u);
    EXPECT_TRUE(torch::equal(values[0], in_file.at(units[3].name + ".weight")));
    EXPECT_TRUE(torch::equal(values[1], in_file.at(units[3].name + ".bias")));
  }
  {
    auto t = build();
    ASSERT_TRUE(t);
    const auto units = t->param_units();
    ASSERT_EQ(units.size(), 10u);
    // Truncated in place to its first 4 KiB.
    std::filesystem::resize_file(file, 4096);
    try {
      (void)units[9].initial();
      ADD_FAILURE() << "a truncated file gave values";
    } catch (const std::exception& e) {
      const std::string why = e.what();
      EXPECT_NE(why.find("model.file '" + file + "' was changed in place since it was loaded"), std::string::npos) << why;
      EXPECT_EQ(why.find('\n'), std::string::npos) << why;
    }
  }
  {
    auto t = build();
    ASSERT_TRUE(t);
    const auto units = t->param_units();
    // The same bytes written again into it: its modification time moved.
    std::string bytes;
    {
      std::ifstream in(file, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    struct timespec later[2] = {{0, UTIME_OMIT}, {0, 0}};
    ASSERT_EQ(::clock_gettime(CLOCK_REALTIME, &later[1]), 0);
    later[1].tv_sec += 5;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
    ASSERT_EQ(::utimensat(AT_FDCWD, file.c_str(), later, 0), 0);
    EXPECT_THROW((void)units[0].initial(), std::runtime_error);
  }
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
  auto bad = make_task(ts_config("bigram.pt", {"data.train_inputs=", "data.train_targets=", "data.train_tokens=" + fixtures() + "/tokens_bad.bin",
                                               "model.context=8", "model.vocab_size=64"}));
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

// The fixtures' classifier data as WebDataset-style tar shards (.npy input,
// .cls target) and as .npy shard pairs: the same sample behind each index as
// with the arrays, and the same learning.
TEST(TorchScript, TarShardsAndNpyShardsGiveTheSamplesOfTheArraysAndTrain) {
  NEED_FIXTURES();
  temp_dir d;
  const std::string f = fixtures();
  const std::vector<std::string> no_arrays = {"data.train_inputs=", "data.train_targets=", "data.eval_inputs=", "data.eval_targets="};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.begin(), no_arrays.begin(), no_arrays.end());
    extra.push_back("data.shuffle_block_shards=2");
    return ts_config("mlp.pt", extra);
  };
  const config arrays = ts_config("mlp.pt");
  const config tars = with({"data.train_shards=" + f + "/tar/train-*.tar", "data.eval_shards=" + f + "/tar/eval-*.tar"});
  const config npys = with({"data.train_inputs=" + f + "/npyshards/train-x-*.npy", "data.train_targets=" + f + "/npyshards/train-y-{000..003}.npy",
                            "data.eval_inputs=" + f + "/npyshards/eval-x-000.npy,", "data.eval_targets=" + f + "/npyshards/eval-y-*.npy"});
  auto reference = make_task(arrays);
  ASSERT_TRUE(reference) << reference.message();
  const std::vector<int64_t> some = {0, 255, 256, 700, 1023};
  auto loss_of = [&](task& t) {
    torch::NoGradGuard no_grad;
    t.module()->eval();  // no dropout
    const double l = t.loss_sum(some).item<double>();
    t.module()->train();
    return l;
  };
  const double want = loss_of(*reference.value());
  for (const config* c : {&tars, &npys}) {
    auto t = make_task(*c);
    ASSERT_TRUE(t) << t.message();
    EXPECT_EQ(t.value()->train_size(), 1024);
    EXPECT_EQ(t.value()->eval_size(), 256);
    EXPECT_EQ(t.value()->train_shard_samples(), std::vector<int64_t>(4, 256));
    // The module is loaded from its file: equal losses mean equal samples,
    // whether the samples were decoded ahead on the source's thread or not.
    EXPECT_EQ(loss_of(*t.value()), want);
    for (int round = 0; round < 20; ++round) {
      t.value()->upcoming_samples(some);
      ASSERT_EQ(loss_of(*t.value()), want) << "round " << round;
    }
    auto r = run_training(*c, quiet(d.path() + "/run-" + std::to_string(c == &tars)));
    ASSERT_TRUE(r) << r.message();
    EXPECT_GT(r->last_eval.metrics.at("accuracy"), 0.6) << "10 classes: chance is 0.1";
  }
  // Held out without eval keys: the last data.val_fraction of the shards, whole.
  auto held = make_task(with({"data.train_shards=" + f + "/tar/train-*.tar", "data.val_fraction=0.25"}));
  ASSERT_TRUE(held) << held.message();
  EXPECT_EQ(held.value()->train_size(), 768);
  EXPECT_EQ(held.value()->eval_size(), 256);

  // Mistakes are one line each.
  auto refused = [&](const std::vector<std::string>& extra, const std::string& says) {
    auto t = make_task(with(extra));
    ASSERT_FALSE(t) << says;
    EXPECT_NE(t.message().find(says), std::string::npos) << t.message();
    EXPECT_EQ(t.message().find('\n'), std::string::npos) << t.message();
  };
  refused({"data.train_inputs=" + f + "/npyshards/train-x-*.npy", "data.train_targets=" + f + "/npyshards/train-y-00[012].npy"},
          "data.train_inputs names 4 shard(s), data.train_targets 3: they pair in order");
  refused({"data.train_shards=" + f + "/tar/train-*.tar", "data.shard_inputs=png"}, "sample '000000' has no member of data.shard_inputs (.png)");
  refused({"data.train_shards=" + f + "/tar/train-*.tar", "data.shard_targets=json"}, "data.shard_targets: '.json' members cannot be read");
  refused({"data.train_shards=" + f + "/tar/train-*.tar", "data.train_tokens=" + f + "/tokens.bin"}, "set one of data.train_shards, data.train_tokens");
  refused({"data.train_shards=" + f + "/npyshards/train-x-*.npy"}, "is not a .tar file");
  std::filesystem::create_directories(d.path() + "/cut");
  for (const char* n : {"/train-000.tar", "/train-001.tar"}) std::filesystem::copy_file(f + "/tar" + n, d.path() + "/cut" + n);
  std::filesystem::resize_file(d.path() + "/cut/train-001.tar", 5000);
  refused({"data.train_shards=" + d.path() + "/cut/*.tar"}, "shard " + d.path() + "/cut/train-001.tar: not a valid tar archive");
}

// The built-in ViT on Fashion-MNIST written as PNG tar shards
// (examples/shards/make_tar_shards.py): image i of the shards is image i of
// the IDX files, and the model learns from them.
TEST(TarShards, TheBuiltInVitTrainsFromPngShardsOfFashionMnist) {
  temp_dir d;
  const std::string make = "/usr/bin/python3.11 " + std::string(DTACTOR_SOURCE_DIR) + "/examples/shards/make_tar_shards.py";
  const std::string what = "examples/shards/make_tar_shards.py (python3-pil, python3-numpy, dataset-fashion-mnist)";
  if (auto e = testing::run_fixture(what, make + " --out " + d.path() + "/train --limit 3000 --per-shard 500"); !e.empty()) SKIP_OR_FAIL_IN_CI(e);
  if (auto e = testing::run_fixture(what, make + " --out " + d.path() + "/test --split test --limit 500 --per-shard 250"); !e.empty())
    SKIP_OR_FAIL_IN_CI(e);
  ASSERT_TRUE(write_shard_index(d.path() + "/train/train-*.tar"));
  const std::vector<std::string> shards = {"data.train_shards=" + d.path() + "/train/train-*.tar", "data.eval_shards=" + d.path() + "/test/*.tar",
                                           "data.shuffle_block_shards=2", "train.max_steps=150", "eval.max_samples=500"};
  const config from_shards = testing::tiny_vit_config(shards);
  const config from_idx = testing::tiny_vit_config({"train.max_steps=150", "eval.max_samples=500"});
  torch::manual_seed(5);
  auto a = make_task(from_shards);
  ASSERT_TRUE(a) << a.message();
  torch::manual_seed(5);
  auto b = make_task(from_idx);
  ASSERT_TRUE(b) << b.message();
  EXPECT_EQ(a.value()->train_size(), 3000);
  EXPECT_EQ(a.value()->eval_size(), 500);
  EXPECT_EQ(a.value()->train_shard_samples(), std::vector<int64_t>(6, 500));
  {
    torch::NoGradGuard no_grad;
    const std::vector<int64_t> some = {0, 499, 500, 2999};
    EXPECT_EQ(a.value()->loss_sum(some).item<double>(), b.value()->loss_sum(some).item<double>()) << "the same parameters and pixels";
  }
  auto r = run_training(from_shards, quiet(d.path() + "/run"));
  ASSERT_TRUE(r) << r.message();
  EXPECT_GT(r->last_eval.metrics.at("accuracy"), 0.35) << "10 classes: chance is 0.1";
  const auto j = testing::read_journal(d.path() + "/run/journal.jsonl");
  bool read_local = false;
  for (const auto& e : testing::events_named(j, "resources"))
    for (const auto& rank : e["ranks"]) read_local = read_local || rank.value("data_bytes_local", 0.0) > 0;
  EXPECT_TRUE(read_local) << "the resources rows count the shard bytes read";
  // Images of another size, and class ids outside model.classes: one line.
  auto small = make_task(testing::tiny_vit_config({"data.train_shards=" + d.path() + "/train/train-*.tar", "model.classes=5", "train.max_steps=1"}));
  ASSERT_TRUE(small) << small.message();
  try {
    (void)small.value()->loss_sum({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
    ADD_FAILURE() << "class ids up to 9 with model.classes = 5";
  } catch (const data_error& e) {
    EXPECT_NE(std::string(e.what()).find("outside model.classes = 5"), std::string::npos) << e.what();
  }
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
