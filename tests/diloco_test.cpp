// train.sync = diloco (model/diloco.hpp): the inner steps of each worker,
// the outer Nesterov step on the workers' averaged pseudo-gradients through
// the data-parallel reducer (Gloo and shared memory), against the formula
// computed here by hand from workers trained alone; a world of one; the
// outer state in the state stream. Ranks are threads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>

#include "model/diloco.hpp"
#include "model/trainer.hpp"
#include "rank/state_io.hpp"
#include "rank_threads.hpp"
#include "comm/grad_sync.hpp"
#include "comm/step_control.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using testing::make_states;
using testing::run_ranks;
using testing::run_ranks_shm;
using testing::tiny_vit_config;

config diloco_config(int every, std::vector<std::string> extra = {}) {
  extra.insert(extra.end(), {"train.sync=diloco", "train.sync_every=" + std::to_string(every)});
  return tiny_vit_config(extra);
}

std::vector<torch::Tensor> flat_params(training_state& s) {
  std::vector<torch::Tensor> out;
  for (const auto& p : s.optimizer().flat_params()) out.push_back(p.clone());
  return out;
}

// `windows` windows of `every` inner steps and an outer step each, for
// every rank of `world`, through a reducer on `pg` (and `shm`, when given).
std::string run_windows(training_state& s, int rank, int world, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm,
                        int every, int windows, step_control* agreed = nullptr) {
  grad_sync_options o;
  o.bucket_bytes = 16 * 1024;
  o.carry_control = true;
  o.exchange.transport = exchange_transport::shared_memory;
  o.shm = std::move(shm);
  grad_sync sync(s.the_task().module()->parameters(), pg, o);
  for (int w = 0; w < windows; ++w) {
    for (int i = 0; i < every; ++i) {
      if (s.outer().due(s.step())) return "a boundary fell inside the window at step " + std::to_string(s.step());
      auto r = s.train_step(step_context::diloco_inner(rank, world));
      if (!r) return r.message();
    }
    if (!s.outer().due(s.step())) return "no boundary at step " + std::to_string(s.step());
    step_control c;
    c.stop = rank == 1 ? 1.f : 0.f;
    sync.set_control(c);
    auto o2 = s.outer().step(s.step(), sync);
    if (!o2) return o2.message();
    if (o2->inner_steps != every) return "the window had " + std::to_string(o2->inner_steps) + " inner steps";
    if (agreed) *agreed = sync.control();
  }
  return "";
}

// The outer step by hand: workers trained alone for a window, then
// global -= lr * (avg + mu * (mu * m + avg)) with the average of
// (global - local) over the workers; every worker ends on it.
void expect_outer_step_matches_the_formula(bool shared_memory) {
  const int world = 2, every = 3;
  const auto cfg = diloco_config(every);
  auto alone = make_states(cfg, world);
  auto dp = make_states(cfg, world);
  const auto start = flat_params(*alone[0]);
  for (int r = 0; r < world; ++r)
    for (int i = 0; i < every; ++i) ASSERT_TRUE(alone[static_cast<size_t>(r)]->train_step(step_context::diloco_inner(r, world)).ok());
  // The workers went apart in their window: each saw its own samples.
  EXPECT_FALSE(torch::equal(alone[0]->optimizer().flat_params()[0], alone[1]->optimizer().flat_params()[0]));
  std::vector<torch::Tensor> want;
  for (size_t g = 0; g < start.size(); ++g) {
    auto d0 = start[g] - alone[0]->optimizer().flat_params()[g];
    auto d1 = start[g] - alone[1]->optimizer().flat_params()[g];
    auto avg = (d0 + d1) / 2.0;
    auto m = avg.clone();  // 0.9 * 0 + avg
    want.push_back(start[g] - (avg + 0.9 * m) * 0.7);
  }
  std::vector<step_control> agreed(world);
  const int64_t floats = dp[0]->optimizer().total_elements() + step_control::words;
  auto body = [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) {
    return run_windows(*dp[static_cast<size_t>(rank)], rank, world, pg, shm, every, 1, &agreed[static_cast<size_t>(rank)]);
  };
  const auto errors = shared_memory ? run_ranks_shm(world, floats, body)
                                    : run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) { return body(rank, pg, nullptr); });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 0; r < world; ++r) {
    auto& s = *dp[static_cast<size_t>(r)];
    EXPECT_EQ(s.step(), every);
    EXPECT_EQ(s.outer().anchor(), every);
    const auto got = s.optimizer().flat_params();
    for (size_t g = 0; g < want.size(); ++g) {
      // The reducer sums two floats (exact in either order); the rest is
      // the same arithmetic, so the result is close to the last bits.
      EXPECT_TRUE(torch::allclose(got[g], want[g], 1e-6, 1e-7)) << "rank " << r << " group " << g << ": max difference "
                                                                << (got[g] - want[g]).abs().max().item<double>();
      EXPECT_FALSE(torch::equal(got[g], start[g]));
    }
    // The step control rode the pseudo-gradients' last bucket.
    EXPECT_TRUE(agreed[static_cast<size_t>(r)].stop_agreed()) << "rank " << r;
  }
  // Every worker holds the same parameters after the boundary.
  EXPECT_EQ(dp[0]->params_digest(), dp[1]->params_digest());
}

TEST(DiLoCo, OuterStepOverGlooIsNesterovOnTheAveragedPseudoGradient) { expect_outer_step_matches_the_formula(false); }

TEST(DiLoCo, OuterStepOverSharedMemoryIsNesterovOnTheAveragedPseudoGradient) { expect_outer_step_matches_the_formula(true); }

// Several windows: the momentum carries from one outer step to the next,
// and the workers stay equal at every boundary.
TEST(DiLoCo, MomentumCarriesAcrossWindowsAndWorkersMeetAtEveryBoundary) {
  const int world = 3, every = 2, windows = 3;
  const auto cfg = diloco_config(every);
  auto dp = make_states(cfg, world);
  auto errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) {
    return run_windows(*dp[static_cast<size_t>(rank)], rank, world, pg, nullptr, every, windows);
  });
  for (int r = 0; r < world; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  for (int r = 1; r < world; ++r) EXPECT_EQ(dp[static_cast<size_t>(r)]->params_digest(), dp[0]->params_digest());
  EXPECT_EQ(dp[0]->outer().anchor(), every * windows);
  // The momentum is in the state, the same on every worker, and not zero.
  auto find = [](training_state& s, const std::string& name) {
    for (auto& st : s.state_tensors())
      if (st.name == name) return st.t;
    return torch::Tensor();
  };
  auto m0 = find(*dp[0], "outer/momentum.0"), m2 = find(*dp[2], "outer/momentum.0");
  ASSERT_TRUE(m0.defined());
  EXPECT_TRUE(torch::equal(m0, m2));
  EXPECT_GT(m0.abs().sum().item<double>(), 0);
  EXPECT_EQ(find(*dp[1], "outer/anchor").item<int64_t>(), every * windows);
}

// A world of one (dtactor train): the outer step takes the worker's own
// pseudo-gradient. With outer_lr 1 and no momentum, the global parameters
// become the local ones: DiLoCo of one worker is plain training.
// A lost worker's slice trained again (rank_worker's replay): the very
// inner step that worker took on it (its samples, dropout seed and
// learning rate), applied without moving the step counter.
TEST(DiLoCo, AReplayedSliceIsThatSlicesInnerStepAndLeavesTheStepWhereItWas) {
  const auto cfg = diloco_config(10, {"model.dropout=0.1", "train.warmup_steps=3"});
  auto s = make_states(cfg, 3);
  // s[0] and s[1] take step 0 (its slice 0 of 2) alike; then s[0] its own
  // slice 0 of step 1, s[1] instead worker 1's slice of step 1, replayed.
  for (int i : {0, 1}) ASSERT_TRUE(s[static_cast<size_t>(i)]->train_step(step_context::diloco_inner(0, 2)).ok());
  ASSERT_TRUE(s[2]->train_step(step_context::diloco_inner(0, 2)).ok());
  ASSERT_TRUE(s[2]->train_step(step_context::diloco_inner(1, 2)).ok());  // s[2]: worker 1's slice of step 1, as worker 1 takes it (step 1 -> 2)
  s[1]->record_samples(true);
  auto r = s[1]->train_step(step_context::replay_of(1, 2, {1, {}}));
  ASSERT_TRUE(r.ok()) << r.message();
  EXPECT_EQ(s[1]->step(), 1);
  EXPECT_EQ(s[1]->recorded_samples(), s[1]->order().rank_slice(1, 1, 2));
  EXPECT_EQ(r->samples, static_cast<int64_t>(s[1]->order().rank_slice(1, 1, 2).size()));
  const auto replayed = flat_params(*s[1]);
  const auto taken = flat_params(*s[2]);
  for (size_t g = 0; g < replayed.size(); ++g) EXPECT_TRUE(torch::equal(replayed[g], taken[g])) << "group " << g;
  // Another slice would not have given these parameters.
  ASSERT_TRUE(s[0]->train_step(step_context::replay_of(0, 2, {1, {}})).ok());
  EXPECT_FALSE(torch::equal(flat_params(*s[0])[0], replayed[0]));
}

// Streaming: a slice replayed to some fragments only (the others' outer
// step took it already) moves those fragments exactly as a replay to all
// would, and leaves the others' parameters and moments as they were.
TEST(DiLoCo, AReplayToOneFragmentLeavesTheOtherFragmentsParametersAndMomentsAlone) {
  const auto cfg = diloco_config(10, {"train.sync_fragments=2", "train.sync_overlap=0"});
  auto s = make_states(cfg, 2);
  for (auto& st : s) ASSERT_TRUE(st->train_step(step_context::diloco_inner(0, 2)).ok());  // moments written everywhere
  auto moments_of = [](training_state& st, size_t f) {
    std::vector<torch::Tensor> out;
    const auto bases = st.optimizer().group_bases();
    for (const auto& [g, off, len] : st.outer().fragments()[f].ranges) {
      auto [m, v] = st.optimizer().moments(bases[g] + off, bases[g] + off + len);
      out.push_back(m.clone());
      out.push_back(v.clone());
      out.push_back(st.optimizer().flat_params()[g].narrow(0, off, len).clone());
    }
    return out;
  };
  const auto frag1_before = moments_of(*s[0], 1);
  ASSERT_TRUE(s[0]->train_step(step_context::replay_of(1, 2, {1, {true, false}})).ok());
  ASSERT_TRUE(s[1]->train_step(step_context::replay_of(1, 2, {1, {}})).ok());
  const auto frag0_masked = moments_of(*s[0], 0), frag0_full = moments_of(*s[1], 0);
  ASSERT_EQ(frag0_masked.size(), frag0_full.size());
  for (size_t i = 0; i < frag0_masked.size(); ++i) EXPECT_TRUE(torch::equal(frag0_masked[i], frag0_full[i])) << i;
  const auto frag1_after = moments_of(*s[0], 1), frag1_full = moments_of(*s[1], 1);
  bool moved = false;
  for (size_t i = 0; i < frag1_after.size(); ++i) {
    EXPECT_TRUE(torch::equal(frag1_after[i], frag1_before[i])) << i;
    moved = moved || !torch::equal(frag1_full[i], frag1_before[i]);
  }
  EXPECT_TRUE(moved) << "a replay to every fragment moves fragment 1";
  EXPECT_EQ(s[0]->step(), 1);
}

TEST(DiLoCo, OneWorkerWithUnitOuterStepTrainsAsPlainAdamW) {
  const auto cfg = diloco_config(4, {"train.outer_lr=1", "train.outer_momentum=0"});
  const auto plain_cfg = tiny_vit_config();
  auto d = make_states(cfg, 1);
  auto p = make_states(plain_cfg, 1);
  for (int i = 0; i < 4; ++i) {
    testing::train_alone(*d[0]);
    testing::train_alone(*p[0]);
  }
  EXPECT_EQ(d[0]->outer().anchor(), 4);
  // global - 1 * (global - local): the local parameters up to rounding
  // (later steps would amplify that rounding, so the window is compared).
  const auto a = d[0]->optimizer().flat_params(), b = p[0]->optimizer().flat_params();
  for (size_t g = 0; g < a.size(); ++g) EXPECT_TRUE(torch::allclose(a[g], b[g], 0, 1e-6)) << (a[g] - b[g]).abs().max().item<double>();
  // With the paper's outer step the result differs (the test can fail).
  auto n = make_states(diloco_config(4), 1);
  for (int i = 0; i < 4; ++i) testing::train_alone(*n[0]);
  EXPECT_FALSE(torch::allclose(n[0]->optimizer().flat_params()[0], b[0], 0, 1e-4));
}

// The boundaries: multiples of train.sync_every past the anchor, and the last step.
TEST(DiLoCo, BoundariesFallAtMultiplesOfSyncEveryAndAtTheLastStep) {
  auto s = make_states(diloco_config(4, {"train.max_steps=10"}), 1);
  auto& o = s[0]->outer();
  EXPECT_FALSE(o.due(0));
  EXPECT_FALSE(o.due(3));
  EXPECT_TRUE(o.due(4));
  EXPECT_TRUE(o.due(10));
  EXPECT_EQ(o.boundary_after(5), 8);
  EXPECT_EQ(o.boundary_after(9), 10);
  for (int i = 0; i < 4; ++i) testing::train_alone(*s[0]);
  EXPECT_EQ(o.anchor(), 4);
  EXPECT_FALSE(o.due(4));  // taken
}

TEST(DiLoCo, ZeroShardingIsRefusedInOneLine) {
  auto c = config::load("", {"train.sync=diloco", "train.zero=1"});
  ASSERT_TRUE(c.ok()) << c.message();
  auto s = training_state::create(c.value());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("train.sync = diloco"), std::string::npos) << s.message();
  EXPECT_EQ(s.message().find('\n'), std::string::npos);
  auto bad = config::load("", {"train.sync=sometimes"});
  EXPECT_FALSE(bad.ok());
}

}  // namespace
}  // namespace dtactor

namespace dtactor {
namespace {

// cluster.wire_dtype = int8: the pseudo-gradients cross the group as int8
// with a scale per 256 values. Every worker still ends on the same
// parameters (the sum is taken in rank order everywhere), within the
// quantization's error of the fp32 exchange.
// What the quantized wire delivers, by hand: each rank's values in blocks,
// scale = the block's largest magnitude / levels, rounded to the nearest
// step, summed in fp32 in rank order.
torch::Tensor dequantized(const torch::Tensor& x, int64_t block, double levels) {
  const int64_t n = x.numel(), blocks = (n + block - 1) / block;
  auto padded = torch::zeros({blocks * block}, torch::kFloat);
  padded.narrow(0, 0, n).copy_(x);
  auto v = padded.view({blocks, block});
  auto scale = v.abs().amax(1).div_(levels);
  auto inv = torch::where(scale > 0, scale.reciprocal(), torch::zeros_like(scale));
  auto q = v.mul(inv.unsqueeze(1)).round_().clamp_(-levels, levels);
  return q.mul_(scale.unsqueeze(1)).reshape({-1}).narrow(0, 0, n);
}

// The int8 and int4 wires through the reducer, 2 ranks, a parameter of 300
// values (the last block padded) with a spike in one block: the sum is the
// hand-dequantized values' sum exactly, and the control words are exact.
void expect_quantized_sum(bool int4) {
  const int world = 2;
  const int64_t n = 300;
  std::vector<torch::Tensor> grads;
  for (int r = 0; r < world; ++r) {
    auto g = torch::linspace(-1.0, 1.0, n).mul(static_cast<double>(r + 1)).add(0.013 * r);
    g[17] = 40.0 * (r + 1);  // one block's scale dominated by a spike
    grads.push_back(g);
  }
  const int64_t block = int4 ? int4_block : int8_block;
  const double levels = int4 ? 7.0 : 127.0;
  const auto want = dequantized(grads[0], block, levels) + dequantized(grads[1], block, levels);
  std::vector<torch::Tensor> got(world);
  auto errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto p = torch::zeros({n}, torch::requires_grad());
    grad_sync_options o;
    o.carry_control = true;
    o.exchange.codec = int4 ? wire_codec::int4 : wire_codec::int8;
    grad_sync sync({p}, pg, o);
    p.mutable_grad() = grads[static_cast<size_t>(rank)].clone();
    step_control c;
    c.stop = 1;
    sync.set_control(c);
    auto t = sync.finish();
    if (!t) return t.message();
    if (sync.control().stop != 2.f) return "the control words were not summed exactly";
    got[static_cast<size_t>(rank)] = p.grad().clone();
    return "";
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_TRUE(torch::equal(got[0], want)) << (got[0] - want).abs().max().item<double>();
  EXPECT_TRUE(torch::equal(got[1], want));
  // Not the fp32 sum: the wire rounded.
  EXPECT_FALSE(torch::allclose(got[0], grads[0] + grads[1], 0, 1e-6));
  // Within half a step per rank of each block's scale.
  const double step0 = 40.0 * 2 / levels;
  EXPECT_LT((got[0] - (grads[0] + grads[1])).abs().max().item<double>(), step0);
}

TEST(DiLoCo, Int8WireSumsTheHandQuantizedValues) { expect_quantized_sum(false); }
TEST(DiLoCo, Int4WireSumsTheHandQuantizedValues) { expect_quantized_sum(true); }

void expect_quantized_pseudo_gradients_close(const std::string& wire, double bound) {
  const int world = 3, every = 3;
  auto fp32 = make_states(diloco_config(every), world);
  auto int8 = make_states(diloco_config(every, {"cluster.wire_dtype=" + wire}), world);
  auto train = [&](std::vector<std::unique_ptr<training_state>>& states, bool q) {
    return run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
      auto& s = *states[static_cast<size_t>(rank)];
      grad_sync_options o;
      o.bucket_bytes = 16 * 1024;
      o.carry_control = true;
      if (q) o.exchange.codec = codec_named(wire).value();
      grad_sync sync(s.the_task().module()->parameters(), pg, o);
      for (int i = 0; i < every; ++i)
        if (auto r = s.train_step(step_context::diloco_inner(rank, world)); !r) return r.message();
      step_control c;
      c.newer_plan = 1;
      sync.set_control(c);
      auto r = s.outer().step(s.step(), sync);
      if (!r) return r.message();
      // The control words travel exactly: every rank's 1 is summed.
      if (!sync.control().all_hold_newer_plan(world)) return "the control words were not summed exactly";
      return "";
    });
  };
  for (const auto& e : train(fp32, false)) ASSERT_EQ(e, "");
  for (const auto& e : train(int8, true)) ASSERT_EQ(e, "");
  EXPECT_EQ(int8[0]->params_digest(), int8[1]->params_digest());
  EXPECT_EQ(int8[0]->params_digest(), int8[2]->params_digest());
  EXPECT_NE(int8[0]->params_digest(), fp32[0]->params_digest()) << "quantized: not the fp32 result bit for bit";
  // Each worker's pseudo-gradient is off by at most half a step (its
  // block's largest magnitude / 254); the outer step scales the average by
  // outer_lr * (1 + momentum) = 1.33 on the first boundary.
  const auto a = int8[0]->optimizer().flat_params(), b = fp32[0]->optimizer().flat_params();
  double worst = 0;
  for (size_t g = 0; g < a.size(); ++g) worst = std::max(worst, (a[g] - b[g]).abs().max().item<double>());
  EXPECT_GT(worst, 0);
  EXPECT_LT(worst, bound) << "the inner steps move a parameter by ~lr a step (3 steps of 1e-3 peak at most)";
}

TEST(DiLoCo, Int8PseudoGradientsLandWithinTheQuantizationErrorAndEqualEverywhere) { expect_quantized_pseudo_gradients_close("int8", 1e-3); }
TEST(DiLoCo, Int4PseudoGradientsLandWithinTheQuantizationErrorAndEqualEverywhere) { expect_quantized_pseudo_gradients_close("int4", 2e-3); }

TEST(DiLoCo, Int8WireWithoutDiLoCoIsRefusedInOneLine) {
  auto c = config::load("", {"cluster.wire_dtype=int8"});
  ASSERT_TRUE(c.ok()) << c.message();
  auto s = training_state::create(c.value());
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("train.sync = diloco"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace dtactor
