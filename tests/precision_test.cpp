// train.precision = bf16: the module computes with bf16 parameters and
// gradients, the optimizer keeps fp32 masters and moments, and the state
// (checkpoints, digests, exports) is the masters.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <iterator>

#include "app/train_command.hpp"
#include "model/trainer.hpp"
#include "rank/state_io.hpp"
#include "storage/checkpoint_store.hpp"
#include "test_util.hpp"
#include "train_util.hpp"

namespace dtactor {
namespace {

using testing::quiet;
using testing::temp_dir;
using testing::tiny_vit_config;

// The module's parameters and their gradients are bf16 views of the
// optimizer's compute copies; the state's "model/" tensors are the fp32
// masters, which the compute copies are the rounding of before a forward.
TEST(Precision, Bf16ComputesInBf16AndTheStateIsTheFp32Masters) {
  auto created = training_state::create(tiny_vit_config({"train.precision=bf16"}));
  ASSERT_TRUE(created) << created.message();
  training_state& s = *created.value();
  EXPECT_TRUE(s.optimizer().mixed());
  auto module = s.the_task().module();
  for (const auto& p : module->parameters()) ASSERT_EQ(p.scalar_type(), torch::kBFloat16);
  auto masters_rounded = [&] {
    for (const auto& kv : module->named_parameters())
      if (!torch::equal(s.state_of(kv.value()).to(torch::kBFloat16), kv.value())) return kv.key();
    return std::string();
  };
  for (const auto& st : s.state_tensors()) {
    if (st.name.rfind("model/", 0) == 0) {
      EXPECT_EQ(st.t.scalar_type(), torch::kFloat) << st.name;
    }
  }
  EXPECT_EQ(masters_rounded(), "");
  const auto before = s.state_of(module->parameters()[0]).clone();
  s.forward_backward(s.order().rank_slice(0, 0, 1), 0);
  for (const auto& p : module->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_EQ(p.grad().scalar_type(), torch::kBFloat16);
  }
  const double norm = s.apply_update();
  EXPECT_GT(norm, 0);
  // The update moved the masters by less than a bf16 step can show: the
  // masters keep it, and the next forward computes with their rounding.
  const auto after = s.state_of(module->parameters()[0]);
  EXPECT_FALSE(torch::equal(before, after));
  s.forward_backward(s.order().rank_slice(1, 0, 1), 1);
  EXPECT_EQ(masters_rounded(), "");
}

// Stopped at step 8 and resumed, a bf16 run ends bit for bit where the
// straight one ends (the checkpoint holds the masters and the moments);
// its export is the fp32 masters, loadable as any fp32 state dict.
TEST(Precision, Bf16ResumesExactlyAndExportsTheFp32Masters) {
  temp_dir straight, interrupted;
  auto cfg = tiny_vit_config({"train.precision=bf16", "train.max_steps=16", "checkpoint.every_steps=4", "model.dropout=0.1"});
  auto a = run_training(cfg, quiet(straight.path()));
  ASSERT_TRUE(a) << a.message();
  auto opts = quiet(interrupted.path());
  opts.stop_at_step = 8;
  auto b1 = run_training(cfg, opts);
  ASSERT_TRUE(b1) << b1.message();
  EXPECT_NE(b1->params_digest, a->params_digest);
  auto b2 = run_training(cfg, quiet(interrupted.path()));
  ASSERT_TRUE(b2) << b2.message();
  EXPECT_EQ(b2->params_digest, a->params_digest);

  auto sd = run_export(straight.path(), straight.path() + "/state.pt", true);
  ASSERT_TRUE(sd) << sd.message();
  std::ifstream in(straight.path() + "/state.pt", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  auto ckpt = open_checkpoint_target(straight.path(), {});
  ASSERT_TRUE(ckpt) << ckpt.message();
  auto state = training_state::create(cfg);
  ASSERT_TRUE(state) << state.message();
  ASSERT_TRUE(load_checkpoint(*state.value(), *ckpt->store, ckpt->meta).ok());
  int checked = 0;
  for (const auto& kv : state.value()->the_task().module()->named_parameters()) {
    const auto t = dict.at(kv.key()).toTensor();
    EXPECT_EQ(t.scalar_type(), torch::kFloat) << kv.key();
    EXPECT_TRUE(torch::equal(t, state.value()->state_of(kv.value()))) << kv.key();
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// Every built-in model trains in bf16: the ViT's images, the GPT's and the
// Transformer's positions and masks meet bf16 parameters, and the loss falls.
TEST(Precision, Bf16TrainsEveryBuiltInModel) {
  for (const std::string model : {"vit", "gpt", "transformer"}) {
    SCOPED_TRACE(model);
    std::vector<std::string> o = {"train.precision=bf16", "train.max_steps=30", "train.warmup_steps=2", "train.lr=0.003", "model.name=" + model};
    if (model != "vit") o.insert(o.end(), {"model.context=32", "data.max_text_bytes=300000", "train.global_batch_size=16"});
    auto created = training_state::create(tiny_vit_config(o));
    ASSERT_TRUE(created) << created.message();
    training_state& s = *created.value();
    std::vector<double> losses;
    for (int step = 0; step < 30; ++step) {
      const auto samples = s.order().rank_slice(step, 0, 1);
      losses.push_back(s.forward_backward(samples, step) / static_cast<double>(samples.size()));
      s.apply_update();
    }
    EXPECT_TRUE(std::isfinite(losses.back()));
    EXPECT_LT(losses.back(), 0.9 * losses.front()) << losses.front() << " -> " << losses.back();
    const auto r = s.evaluate();
    EXPECT_TRUE(std::isfinite(r.metrics.begin()->second));
  }
}

}  // namespace
}  // namespace dtactor
