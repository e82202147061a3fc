#include "model/layers.hpp"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dtactor
