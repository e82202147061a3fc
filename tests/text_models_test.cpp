// The Transformer (English->Italian) and GPT (GCIDE) tasks: shapes, the
// loss_sum contract, learning, decoding, activation checkpointing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <memory>

#include "model/gpt.hpp"
#include "model/transformer.hpp"

namespace dtactor {
namespace {

config small_config(int64_t context) {
  config c;
  for (const auto& [k, v] : std::vector<std::pair<std::string, std::string>>{{"model.dim", "32"},
                                                                             {"model.layers", "1"},
                                                                             {"model.heads", "4"},
                                                                             {"model.mlp_ratio", "2"},
                                                                             {"model.dropout", "0"},
                                                                             {"model.context", std::to_string(context)},
                                                                             {"model.label_smoothing", "0.1"},
                                                                             {"data.val_fraction", "0.1"},
                                                                             {"data.max_text_bytes", "300000"}}) {
    auto st = c.set(k, v);
    EXPECT_TRUE(st.ok()) << st.message();
  }
  return c;
}

// The data sets are read once for the whole file.
const word_pairs& pairs() {
  static const word_pairs p = [] {
    auto r = load_eng_ita_pairs("/usr/share/dictd/freedict-eng-ita", 16, 0.1);
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? r.value() : word_pairs{};
  }();
  return p;
}

const text_corpus& corpus() {
  static const text_corpus c = [] {
    auto r = load_gcide_corpus("/usr/share/dictd/gcide", 0.1, 300000);
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? r.value() : text_corpus{};
  }();
  return c;
}

std::unique_ptr<task> make_small(const std::string& which, uint64_t seed, bool checkpointed = false, int64_t layers = 1) {
  config c = small_config(which == "gpt" ? 32 : 16);
  EXPECT_TRUE(c.set("train.activation_checkpointing", checkpointed ? "true" : "false").ok());
  EXPECT_TRUE(c.set("model.layers", std::to_string(layers)).ok());
  auto s = job_settings_of(c);
  EXPECT_TRUE(s.ok()) << s.message();
  torch::manual_seed(seed);
  if (which == "gpt") return std::make_unique<gpt_task>(s.value(), corpus());
  return std::make_unique<transformer_task>(s.value(), pairs());
}

// Trains on one fixed batch; returns the losses (mean per sample) before and after.
std::pair<double, double> overfit(task& t, const std::vector<int64_t>& batch, int steps, double lr) {
  auto params = t.module()->parameters();
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(lr).weight_decay(0.0));
  t.module()->train();
  const double n = static_cast<double>(batch.size());
  double first = 0, last = 0;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto loss = t.loss_sum(batch) / n;
    loss.backward();
    opt.step();
    if (s == 0) first = loss.item<double>();
  }
  {
    torch::NoGradGuard no_grad;
    last = t.loss_sum(batch).item<double>() / n;
  }
  return {first, last};
}

void expect_sum_of_parts(task& t, const std::vector<int64_t>& indices) {
  torch::NoGradGuard no_grad;
  t.module()->eval();
  const double whole = t.loss_sum(indices).item<double>();
  double parts = 0;
  for (int64_t i : indices) parts += t.loss_sum({i}).item<double>();
  EXPECT_NEAR(whole, parts, 1e-4 * std::abs(parts)) << "loss_sum must be the sum of per-sample losses";
  // Splitting the batch in two gives the same sum as well.
  const size_t half = indices.size() / 2;
  std::vector<int64_t> a(indices.begin(), indices.begin() + static_cast<std::ptrdiff_t>(half)), b(indices.begin() + static_cast<std::ptrdiff_t>(half), indices.end());
  EXPECT_NEAR(whole, t.loss_sum(a).item<double>() + t.loss_sum(b).item<double>(), 1e-4 * std::abs(whole));
}

void expect_same_gradients(const std::string& which) {
  auto plain = make_small(which, 7, false, 2);
  auto ckpt = make_small(which, 7, true, 2);
  const std::vector<int64_t> batch{0, 3, 11, 42, 77, 150, 301, 512};
  plain->module()->train();
  ckpt->module()->train();
  auto l1 = plain->loss_sum(batch);
  auto l2 = ckpt->loss_sum(batch);
  EXPECT_NEAR(l1.item<double>(), l2.item<double>(), 1e-5 * std::abs(l1.item<double>()));
  l1.backward();
  l2.backward();
  auto p1 = plain->module()->named_parameters(), p2 = ckpt->module()->named_parameters();
  ASSERT_EQ(p1.size(), p2.size());
  int64_t compared = 0;
  for (const auto& item : p1) {
    const auto& g1 = item.value().grad();
    const auto& g2 = p2[item.key()].grad();
    ASSERT_TRUE(g1.defined()) << item.key();
    ASSERT_TRUE(g2.defined()) << item.key() << " has no gradient under checkpointing";
    EXPECT_TRUE(torch::allclose(g1, g2, 1e-4, 1e-6)) << item.key() << " max diff " << (g1 - g2).abs().max().item<double>();
    ++compared;
  }
  EXPECT_GT(compared, 10);
}

TEST(TextTransformer, VocabularyRoundTrips) {
  char_vocab v(pairs().train);
  EXPECT_GT(v.size(), 40);
  EXPECT_LT(v.size(), 120);
  auto ids = v.encode("città");
  EXPECT_EQ(ids.size(), 5u);
  for (auto id : ids) EXPECT_GE(id, 4);
  EXPECT_EQ(v.decode(ids), "città");
  ids.push_back(char_vocab::eos);
  ids.push_back(ids.front());
  EXPECT_EQ(v.decode(ids), "città");  // stops at eos
  EXPECT_EQ(v.encode("\x01")[0], char_vocab::unk);
}

TEST(TextTransformer, ShapesAndLossContract) {
  auto t = make_small("transformer", 1);
  auto& tt = dynamic_cast<transformer_task&>(*t);
  EXPECT_GT(t->train_size(), 3000);
  EXPECT_GT(t->eval_size(), 200);
  auto src = torch::tensor(std::vector<int64_t>{5, 6, 7, char_vocab::eos, 5, char_vocab::eos, 0, 0}, torch::kLong).view({2, 4});
  auto tgt = torch::tensor(std::vector<int64_t>{char_vocab::bos, 8, 9, char_vocab::bos, 8, 0}, torch::kLong).view({2, 3});
  auto logits = tt.model()->forward(src, tgt);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 3, tt.vocab().size()}));
  auto loss = t->loss_sum({0, 1, 2, 3});
  EXPECT_EQ(loss.dim(), 0);
  // Near-uniform start: each sample's loss is close to log(vocab).
  EXPECT_NEAR(loss.item<double>() / 4, std::log(static_cast<double>(tt.vocab().size())), 1.5);
  // Words of different lengths, so batches are padded differently.
  expect_sum_of_parts(*t, {0, 7, 100, 901, 1500, 2222, 3000, 5});
}

TEST(TextTransformer, LearnsAndDecodes) {
  auto t = make_small("transformer", 2);
  std::vector<int64_t> batch;
  for (int64_t i = 0; i < 48; ++i) batch.push_back(i * 61 % t->train_size());
  auto [first, last] = overfit(*t, batch, 40, 0.01);
  std::printf("transformer: loss %.3f -> %.3f in 40 steps\n", first, last);
  EXPECT_LT(last, 0.6 * first);

  torch::NoGradGuard no_grad;
  t->module()->eval();
  auto& tt = dynamic_cast<transformer_task&>(*t);
  auto out = tt.translate({"house", "a much longer input word"});
  ASSERT_EQ(out.size(), 2u);
  for (const auto& s : out) EXPECT_LE(utf8_length(s), 17);
  auto r = t->evaluate(40, 16);
  for (const char* m : {"val_loss", "exact_match", "char_accuracy"}) ASSERT_EQ(r.metrics.count(m), 1u) << m;
  EXPECT_TRUE(std::isfinite(r.metrics["val_loss"]));
  EXPECT_GE(r.metrics["exact_match"], 0.0);
  EXPECT_LE(r.metrics["exact_match"], 1.0);
  EXPECT_GT(r.metrics["char_accuracy"], 0.0);
  ASSERT_FALSE(r.examples.empty());
  EXPECT_NE(r.examples[0].find(" -> "), std::string::npos);
  EXPECT_NE(r.examples[0].find("(target: " + tt.data().held_out[0].italian + ")"), std::string::npos) << r.examples[0];
}

TEST(TextTransformer, CheckpointingGivesTheSameGradients) { expect_same_gradients("transformer"); }

TEST(TextTransformer, MakeTaskReportsMissingData) {
  config c = small_config(16);
  ASSERT_TRUE(c.set("data.freedict_eng_ita", "/nonexistent/freedict-eng-ita").ok());
  auto r = make_transformer_task(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("dict-freedict-eng-ita"), std::string::npos) << r.message();
}

TEST(TextGpt, ShapesAndLossContract) {
  auto t = make_small("gpt", 1);
  auto& g = dynamic_cast<gpt_task&>(*t);
  EXPECT_EQ(t->train_size(), (static_cast<int64_t>(corpus().train.size()) - 1) / 32);
  EXPECT_EQ(t->eval_size(), (static_cast<int64_t>(corpus().held_out.size()) - 1) / 32);
  auto logits = g.model()->forward(torch::zeros({3, 32}, torch::kLong));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{3, 32, 256}));
  auto loss = t->loss_sum({0, 1});
  EXPECT_NEAR(loss.item<double>() / 2, std::log(256.0), 0.3);  // GPT-2 style init starts near uniform
  EXPECT_THROW(t->loss_sum({t->train_size()}), c10::Error);
  expect_sum_of_parts(*t, {0, 1, 2, 999, t->train_size() - 1});
}

TEST(TextGpt, LearnsAndGenerates) {
  auto t = make_small("gpt", 2);
  std::vector<int64_t> batch;
  for (int64_t i = 0; i < 32; ++i) batch.push_back(i * 97 % t->train_size());
  auto [first, last] = overfit(*t, batch, 40, 0.01);
  std::printf("gpt: loss %.3f -> %.3f in 40 steps\n", first, last);
  EXPECT_LT(last, 0.7 * first);

  torch::NoGradGuard no_grad;
  t->module()->eval();
  auto& g = dynamic_cast<gpt_task&>(*t);
  const auto text = g.model()->generate("Water", 20);
  EXPECT_EQ(text.size(), 25u);
  EXPECT_EQ(text.substr(0, 5), "Water");
  auto r = t->evaluate(64, 16);
  ASSERT_EQ(r.metrics.count("val_loss"), 1u);
  ASSERT_EQ(r.metrics.count("perplexity"), 1u);
  EXPECT_LT(r.metrics["val_loss"], std::log(256.0));
  EXPECT_NEAR(r.metrics["perplexity"], std::exp(r.metrics["val_loss"]), 1e-6 * r.metrics["perplexity"]);
  ASSERT_EQ(r.examples.size(), 1u);
  EXPECT_EQ(r.examples[0].find('\n'), std::string::npos);
  std::printf("gpt example: %s\n", r.examples[0].c_str());
}

TEST(TextGpt, CheckpointingGivesTheSameGradients) { expect_same_gradients("gpt"); }

TEST(TextGpt, EvaluationIsDeterministicAndBatchIndependent) {
  auto t = make_small("gpt", 3);
  torch::NoGradGuard no_grad;
  t->module()->eval();
  auto a = t->evaluate(48, 48), b = t->evaluate(48, 7);
  EXPECT_NEAR(a.metrics["val_loss"], b.metrics["val_loss"], 1e-5);
  EXPECT_EQ(a.examples, b.examples);
}

TEST(TextGpt, MakeTaskReportsMissingAndTooLittleData) {
  config c = small_config(32);
  ASSERT_TRUE(c.set("data.gcide", "/nonexistent/gcide").ok());
  auto r = make_gpt_task(c);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.message().find("dict-gcide"), std::string::npos) << r.message();

  config tiny = small_config(32);
  ASSERT_TRUE(tiny.set("data.max_text_bytes", "20").ok());
  auto r2 = make_gpt_task(tiny);
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.message().find("data.max_text_bytes"), std::string::npos) << r2.message();
}

}  // namespace
}  // namespace dtactor
