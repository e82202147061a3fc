#include "model/layers.hpp"

#include <gtest/gtest.h>

#include <optional>

#include "model/vit.hpp"

namespace dtactor {
namespace {

TEST(Layers, CausalMaskHidesTheFuture) {
  auto m = causal_mask(3);
  EXPECT_EQ(m[0][0].item<float>(), 0.f);
  EXPECT_TRUE(std::isinf(m[0][1].item<float>()));
  EXPECT_EQ(m[2][1].item<float>(), 0.f);
}

TEST(Layers, SinusoidalPositions) {
  auto pe = sinusoidal_positions(5, 8);
  EXPECT_EQ(pe.sizes(), (std::vector<int64_t>{5, 8}));
  EXPECT_FLOAT_EQ(pe[0][0].item<float>(), 0.f);
  EXPECT_FLOAT_EQ(pe[0][1].item<float>(), 1.f);
  EXPECT_NEAR(pe[1][0].item<float>(), std::sin(1.0), 1e-6);
}

TEST(Layers, CausalAttentionIgnoresLaterTokens) {
  torch::manual_seed(0);
  block b(block_options{16, 2, 2.0, 0.0, false, false});
  auto x = torch::randn({1, 5, 16});
  auto y1 = b->forward(x, causal_mask(5));
  auto x2 = x.clone();
  x2.index_put_({0, 4}, torch::randn({16}));
  auto y2 = b->forward(x2, causal_mask(5));
  EXPECT_TRUE(torch::allclose(y1.slice(1, 0, 4), y2.slice(1, 0, 4)));
  EXPECT_FALSE(torch::allclose(y1.slice(1, 4, 5), y2.slice(1, 4, 5)));
}

// Activation checkpointing must not change the math, dropout included.
TEST(Layers, ActivationCheckpointingGivesTheSameGradients) {
  auto grads = [](bool checkpointed) {
    torch::manual_seed(1);
    vit_options o;
    o.layers = 2;
    o.blk = block_options{16, 2, 2.0, 0.2, false, checkpointed};
    vit m(o);
    m->train();
    torch::manual_seed(2);
    auto x = torch::randn({4, 1, 28, 28});
    auto loss = m->forward(x).pow(2).sum();
    loss.backward();
    std::vector<torch::Tensor> g;
    for (auto& p : m->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto plain = grads(false), ckpt = grads(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-5, 1e-6)) << "parameter " << i;
}

// Blocks built under defer_block_values keep no values (their parameters are
// zero-strided views of one element) and leave the generator where a normal
// build leaves it, so everything built after them is the same; each unit's `initial` gives the normal build's
// values bit for bit, in parameter order, and does not move the generator.
TEST(Layers, BlocksBuiltDeferredMakeTheirInitialValuesAgainBitForBit) {
  vit_options o;
  o.layers = 3;
  o.blk = block_options{16, 2, 2.0, 0.0, false, false};
  torch::manual_seed(7);
  vit plain(o);
  const auto after_plain = torch::rand({4});
  torch::manual_seed(7);
  std::optional<vit> deferred;
  {
    defer_block_values defer(true);
    deferred.emplace(o);
  }
  const auto after_deferred = torch::rand({4});
  EXPECT_TRUE(torch::equal(after_plain, after_deferred)) << "the generator moved differently";
  auto pu = block_units(plain->blocks, "blocks"), du = block_units((*deferred)->blocks, "blocks");
  ASSERT_EQ(du.size(), 3u);
  for (size_t u = 0; u < du.size(); ++u) {
    SCOPED_TRACE("unit " + std::to_string(u));
    EXPECT_FALSE(pu[u].initial) << "a normal build defers nothing";
    ASSERT_TRUE(du[u].initial);
    for (const auto& p : du[u].params) EXPECT_TRUE(awaits_initial_values(p));
    const auto values = du[u].initial();
    ASSERT_EQ(values.size(), pu[u].params.size());
    for (size_t i = 0; i < values.size(); ++i) EXPECT_TRUE(torch::equal(values[i], pu[u].params[i])) << "parameter " << i;
  }
  // Outside the blocks (patch embedding, class token, positions, head): built as always.
  EXPECT_TRUE(torch::equal(plain->head->weight, (*deferred)->head->weight));
  EXPECT_TRUE(torch::equal(plain->pos_embed, (*deferred)->pos_embed));
  // initial() leaves the generator where it was.
  torch::manual_seed(9);
  const auto x = torch::rand({4});
  torch::manual_seed(9);
  (void)du[1].initial();
  EXPECT_TRUE(torch::equal(torch::rand({4}), x));
}

}  // namespace
}  // namespace dtactor
