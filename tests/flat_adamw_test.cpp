#include "model/flat_adamw.hpp"

#include "model/adamw_kernel.hpp"
#include "model/grad_norm.hpp"
#include "model/shard_plan.hpp"
#include "test_util.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <set>
#include <utility>
#include <vector>
#include <cstring>
#include <random>
#include <sstream>

namespace dtactor {
namespace {

// A small MLP with weights (decayed) and biases (not decayed).
struct net : torch::nn::Module {
  net() {
    a = register_module("a", torch::nn::Linear(6, 8));
    b = register_module("b", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

std::shared_ptr<net> make_net(uint64_t seed) {
  torch::manual_seed(seed);
  return std::make_shared<net>();
}

void backward_on(net& n, int64_t step) {
  torch::manual_seed(1000 + step);
  auto x = torch::randn({5, 6});
  n.forward(x).pow(2).sum().backward();
}

std::vector<torch::Tensor> snapshot(net& n) {
  std::vector<torch::Tensor> out;
  for (auto& p : n.parameters()) out.push_back(p.detach().clone());
  return out;
}

double max_abs_diff(const std::vector<torch::Tensor>& x, const std::vector<torch::Tensor>& y) {
  double d = 0;
  for (size_t i = 0; i < x.size(); ++i) d = std::max(d, (x[i] - y[i]).abs().max().item<double>());
  return d;
}

// The reference: LibTorch's AdamW with a decay and a no-decay group, clip_grad_norm_.
struct reference {
  explicit reference(net& n, const flat_adamw_options& o) : n_(n) {
    std::vector<torch::Tensor> decay, no_decay;
    for (auto& p : n.parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
    auto opts = torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay);
    auto nd = std::make_unique<torch::optim::AdamWOptions>(opts);
    nd->weight_decay(0.0);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(opts));
    groups.emplace_back(no_decay, std::move(nd));
    opt = std::make_unique<torch::optim::AdamW>(std::move(groups), opts);
  }
  double step(double clip) {
    const double norm = torch::nn::utils::clip_grad_norm_(n_.parameters(), clip);
    opt->step();
    opt->zero_grad();
    return norm;
  }
  net& n_;
  std::unique_ptr<torch::optim::AdamW> opt;
};

flat_adamw_options options() {
  flat_adamw_options o;
  o.lr = 0.05;
  o.weight_decay = 0.1;
  return o;
}

TEST(FlatAdamW, MatchesLibTorchAdamWWithClipping) {
  auto n1 = make_net(7), n2 = make_net(7);
  reference ref(*n1, options());
  flat_adamw flat(n2->parameters(), options());
  for (int64_t s = 0; s < 20; ++s) {
    backward_on(*n1, s);
    backward_on(*n2, s);
    const double clip = s % 2 ? 0.5 : 1e9;  // clipping on every other step
    const double a = ref.step(clip);
    const double b = flat.clip_grad_norm(clip);
    flat.step();
    flat.zero_grad();
    EXPECT_NEAR(a, b, 1e-5 * std::max(1.0, a)) << "gradient norm at step " << s;
  }
  // Same arithmetic element by element; only the norm's summation order differs.
  EXPECT_LT(max_abs_diff(snapshot(*n1), snapshot(*n2)), 1e-5);
  EXPECT_GT(max_abs_diff(snapshot(*n1), snapshot(*make_net(7))), 1e-2) << "the parameters did not move";
}

// A reshard whose new window has an old window's exact range keeps that
// window's moments as they are (no copy, no new pages: a survivor whose
// shards do not change pays nothing), and a rank holding no window (a
// stale rank before its reshard: training_state::drop_stale_moments) makes
// no moment resident when its state is laid out for a transfer.
TEST(FlatAdamW, AWindowOfTheSameRangeKeepsItsMomentsAndNoWindowHoldsNoBytes) {
  auto n = make_net(7);
  flat_adamw f(n->parameters(), options());
  const int64_t total = f.total_elements();
  const int64_t base = f.group_bases()[0];
  f.shard({{0, total}});
  for (int64_t s = 0; s < 2; ++s) {
    backward_on(*n, s);
    f.step();
    f.zero_grad();
  }
  const auto [m, v] = f.moments(base, base + 4);
  const void* at = m.data_ptr();
  const auto values = m.clone();
  f.shard({{0, total}});
  const auto [m2, v2] = f.moments(base, base + 4);
  EXPECT_EQ(m2.data_ptr(), at) << "the same range: the same moments";
  EXPECT_TRUE(torch::equal(m2, values));
  f.drop_retired();
  EXPECT_TRUE(torch::equal(f.moments(base, base + 4).first, values));

  flat_adamw fresh(make_net(8)->parameters(), options());
  fresh.shard({{0, total}});  // a fresh rank's whole window: lazy zeros
  fresh.shard({});
  EXPECT_TRUE(fresh.held_ranges().empty());
  for (const auto& t : fresh.state_tensors()) EXPECT_EQ(t.t.numel(), 0) << t.name;
  EXPECT_EQ(fresh.state_bytes(), 0);
}

TEST(FlatAdamW, AWindowOfTheSameRangeKeepsItsGradientBuffer) {
  auto n = make_net(9);
  flat_adamw f(n->parameters(), options());
  const int64_t total = f.total_elements();
  const int64_t base = f.group_bases()[0];
  f.shard({{0, total}});
  f.shard_grads();  // train.zero = 2: the gradients live in the windows
  backward_on(*n, 0);
  f.step();
  f.zero_grad();
  const void* at = f.grad_window(base, base + 4).data_ptr();
  f.shard({{0, total}});
  EXPECT_EQ(f.grad_window(base, base + 4).data_ptr(), at) << "the same range: the same gradient buffer, its pages already in";
  f.drop_retired();
  f.shard({{0, total / 2}});
  EXPECT_NE(f.grad_window(base, base + 4).data_ptr(), at) << "another range: a buffer of its own";
}

TEST(FlatAdamW, ParametersAndGradientsAreViewsOfOneBufferPerGroup) {
  auto n = make_net(3);
  flat_adamw flat(n->parameters(), options());
  backward_on(*n, 0);
  // autograd accumulated into the views: the weights' grads are adjacent.
  auto wa = n->a->weight, wb = n->b->weight;
  EXPECT_EQ(static_cast<float*>(wa.grad().data_ptr()) + wa.numel(), static_cast<float*>(wb.grad().data_ptr()));
  EXPECT_EQ(static_cast<float*>(wa.data_ptr()) + wa.numel(), static_cast<float*>(wb.data_ptr()));
}

TEST(FlatAdamW, ReplacedOrResetGradientsAreTakenBackIntoTheBuffer) {
  auto n1 = make_net(5), n2 = make_net(5);
  flat_adamw f1(n1->parameters(), options()), f2(n2->parameters(), options());
  for (int64_t s = 0; s < 3; ++s) {
    backward_on(*n1, s);
    f1.step();
    f1.zero_grad();
    n2->zero_grad(/*set_to_none=*/true);  // grads are no longer the buffer's views
    backward_on(*n2, s);
    for (auto& p : n2->parameters()) p.mutable_grad() = p.grad().clone();
    f2.step();
    f2.zero_grad();
  }
  EXPECT_EQ(max_abs_diff(snapshot(*n1), snapshot(*n2)), 0.0);
}

std::string save(flat_adamw& f) {
  torch::serialize::OutputArchive ar;
  f.save(ar);
  std::ostringstream os(std::ios::binary);
  ar.save_to(os);
  return os.str();
}

// make_resident: a fresh optimizer's gradient buffer (an untouched mapping)
// and lazy moments take no memory until touched; made resident, every page
// of the gradients is in memory and the moments are real zeros, and a step
// then gives the same parameters as without it. Sharded: nothing.
TEST(FlatAdamW, MakeResidentTouchesTheGradientsAndMomentsAndChangesNoValue) {
  auto resident_pages = [](const torch::Tensor& t) {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr()) / page * page;
    const auto end = reinterpret_cast<uintptr_t>(t.data_ptr()) + static_cast<uintptr_t>(t.numel() * t.element_size());
    std::vector<unsigned char> v((end - begin + page - 1) / page);
    if (::mincore(reinterpret_cast<void*>(begin), end - begin, v.data()) != 0) return std::make_pair(size_t{0}, size_t{0});
    size_t in = 0;
    for (unsigned char c : v) in += c & 1;
    return std::make_pair(in, v.size());
  };
  auto make = [] {
    torch::manual_seed(3);
    return std::vector<torch::Tensor>{torch::randn({512, 1024}).requires_grad_(true), torch::randn({1024}).requires_grad_(true)};
  };
  auto pa = make(), pb = make();
  flat_adamw a(pa, flat_adamw_options{}), b(pb, flat_adamw_options{});
  EXPECT_EQ(a.state_bytes(), 0) << "lazy moments";
  EXPECT_EQ(resident_pages(a.flat_grads()[0]).first, 0u) << "an untouched gradient buffer";
  EXPECT_EQ(a.resident_bytes(), 3 * (512 * 1024 + 1024) * 4);
  a.make_resident();
  const auto [in, of] = resident_pages(a.flat_grads()[0]);
  EXPECT_EQ(in, of) << "every page of the gradients";
  EXPECT_EQ(a.state_bytes(), 2 * (512 * 1024 + 1024) * 4) << "real moments";
  EXPECT_EQ(a.flat_grads()[0].abs().sum().item<float>(), 0.f);
  for (size_t i = 0; i < pa.size(); ++i) {
    pa[i].mutable_grad().copy_(torch::full_like(pa[i], 0.5));
    pb[i].mutable_grad().copy_(torch::full_like(pb[i], 0.5));
  }
  a.step();
  b.step();
  for (size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(torch::equal(pa[i], pb[i])) << "parameter " << i;
  flat_adamw c(make(), flat_adamw_options{});
  c.shard({{0, 1000}});
  EXPECT_EQ(c.resident_bytes(), 0);
  c.make_resident();
  EXPECT_EQ(c.state_bytes(), 0) << "sharded: left alone";
}

// Mixed precision (compute = bf16): the parameters become bf16 views whose
// values are the masters rounded, their gradients bf16 views; clipping and
// the step read those gradients once as float32, so the masters move
// exactly as a float32 optimizer's given the same (bf16-valued) gradients
// and clipped alike; the copies follow at refresh_compute. make_resident
// touches the bf16 gradients too.
TEST(FlatAdamW, Bf16CopiesFollowTheFp32MastersAndTheGradientsAreReadOnce) {
  auto make = [] {
    torch::manual_seed(5);
    return std::vector<torch::Tensor>{torch::randn({512, 1024}).requires_grad_(true), torch::randn({1024}).requires_grad_(true)};
  };
  auto pm = make(), pf = make();
  flat_adamw_options o;
  o.compute = torch::kBFloat16;
  flat_adamw mixed(pm, o), plain(pf, flat_adamw_options{});
  ASSERT_TRUE(mixed.mixed());
  EXPECT_EQ(mixed.resident_bytes(), 3 * (512 * 1024 + 1024) * 4 + (512 * 1024 + 1024) * 2);
  mixed.make_resident();
  for (size_t i = 0; i < pm.size(); ++i) {
    ASSERT_EQ(pm[i].scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(torch::equal(pm[i], mixed.master_of(pm[i]).to(torch::kBFloat16)));
    EXPECT_EQ(pm[i].grad().scalar_type(), torch::kBFloat16);
  }
  for (int step = 0; step < 3; ++step) {
    torch::manual_seed(10 + step);
    for (size_t i = 0; i < pm.size(); ++i) {
      const auto g = torch::randn(pm[i].sizes()).to(torch::kBFloat16);
      pm[i].mutable_grad().copy_(g);
      pf[i].mutable_grad().copy_(g.to(torch::kFloat));
    }
    EXPECT_EQ(mixed.clip_grad_norm(0.5), plain.clip_grad_norm(0.5));
    mixed.step();
    plain.step();
    mixed.zero_grad();
    plain.zero_grad();
    for (size_t i = 0; i < pm.size(); ++i) EXPECT_TRUE(torch::equal(mixed.master_of(pm[i]), pf[i])) << "step " << step << " parameter " << i;
    EXPECT_FALSE(torch::equal(pm[0], pf[0].to(torch::kBFloat16))) << "the copies move only at refresh_compute";
    mixed.refresh_compute();
    for (size_t i = 0; i < pm.size(); ++i) EXPECT_TRUE(torch::equal(pm[i], pf[i].to(torch::kBFloat16))) << "parameter " << i;
  }
}

// Sharding the gradients of a mixed-precision optimizer (ZeRO-2 and 3 at a
// fresh rank's first generation) converts only the nonzero chunks of the
// bf16 gradients into its windows: converting the whole buffer first made
// 4 bytes a parameter resident on every rank at once, whatever the world
// size (the peak that capped a bf16 model at world 8). A gradient left
// before sharding is still carried, converted.
TEST(FlatAdamW, ShardingBf16GradientsMakesNoWholeFloat32BufferResident) {
  constexpr int64_t n = 16 * 1024 * 1024;  // 64 MB of float32 gradients
  std::vector<torch::Tensor> p{torch::zeros({n}).requires_grad_(true)};
  flat_adamw_options o;
  o.compute = torch::kBFloat16;
  flat_adamw m(p, o);
  ASSERT_TRUE(m.mixed());
  p[0].mutable_grad().narrow(0, 5, 3).fill_(0.25);
  ASSERT_TRUE(testing::reset_peak());
  const int64_t before = testing::status_kb("VmRSS:");
  m.shard_grads();
  const int64_t added_kb = testing::status_kb("VmHWM:") - before;
  // Reading the bf16 gradients for their nonzero chunks maps the kernel's
  // shared zero page where it has one; where it has none (some VM kernels),
  // the read makes the bf16 buffer resident, 2 bytes a parameter. Either
  // way well under a whole float32 buffer converted (4 bytes a parameter,
  // on top of that read).
  const int64_t bf16_kb = n * 2 / 1024, fp32_kb = n * 4 / 1024;
  EXPECT_LT(added_kb, bf16_kb + fp32_kb / 4) << "sharding touched " << added_kb << " kB: the whole float32 gradient is " << fp32_kb << " kB";
  const auto w = m.grad_window(0, 16);
  ASSERT_EQ(w.scalar_type(), torch::kFloat);
  auto want = torch::zeros({16});
  want.narrow(0, 5, 3).fill_(0.25);
  EXPECT_TRUE(torch::equal(w, want)) << w;
}

// A training state shards its gradients (train.zero >= 2) at its first
// generation, before its first backward: it has said they are unwritten
// (grads_unwritten), so shard_grads reads no page of the fresh full
// buffers, fp32 or bf16. Reading them for nonzero chunks mapped every page
// (the shared zero page here, mincore counts it; on a kernel without one,
// memory), 2 or 4 bytes a parameter at once on every rank.
TEST(FlatAdamW, ShardingGradientsNoBackwardWroteReadsNoPageOfThem) {
  constexpr int64_t n = 4 * 1024 * 1024;
  for (bool mixed : {false, true}) {
    SCOPED_TRACE(mixed ? "bf16" : "fp32");
    std::vector<torch::Tensor> p{torch::zeros({n}).requires_grad_(true)};
    flat_adamw_options o;
    if (mixed) o.compute = torch::kBFloat16;
    flat_adamw m(p, o);
    m.grads_unwritten();
    const torch::Tensor full = p[0].grad();  // a view of the full buffer: it outlives shard_grads
    ASSERT_TRUE(full.defined());
    const auto bytes = full.numel() * static_cast<int64_t>(full.element_size());
    ASSERT_EQ(testing::interior_pages(full.data_ptr(), bytes).first, 0u) << "the test needs an untouched buffer";
    m.shard_grads();
    const auto pages = testing::interior_pages(full.data_ptr(), bytes);
    EXPECT_GT(pages.second, 100u);
    EXPECT_EQ(pages.first, 0u) << "shard_grads read " << pages.first << " of " << pages.second << " pages of gradients nothing wrote";
    EXPECT_TRUE(m.grad_window(0, 16).eq(0).all().item<bool>());
  }
}

// ZeRO-1 in mixed precision: sharded, the optimizer keeps float32
// gradients only for its held windows (the bf16 ones stay whole, as the
// reducer allreduces them), and it computes the same norm and the same
// masters as a float32 optimizer sharded alike, across a reshard too.
TEST(FlatAdamW, ShardedBf16KeepsFloat32GradientsOnlyForTheHeldWindows) {
  auto make = [] {
    torch::manual_seed(6);
    return std::vector<torch::Tensor>{torch::randn({512, 1024}).requires_grad_(true), torch::randn({1024}).requires_grad_(true)};
  };
  auto pm = make(), pf = make();
  const int64_t total = 512 * 1024 + 1024;
  flat_adamw_options o;
  o.compute = torch::kBFloat16;
  flat_adamw mixed(pm, o), plain(pf, flat_adamw_options{});
  const std::vector<std::pair<int64_t, int64_t>> first{{100000, 300000}, {524288 + 100, 524288 + 600}}, second{{250000, 525000}};
  for (auto* f : {&mixed, &plain}) f->shard(first);
  EXPECT_EQ(mixed.grad_bytes(), total * 2 + (200000 + 500) * 4) << "the whole bf16 gradients and the held windows' float32 ones";
  for (int step = 0; step < 4; ++step) {
    if (step == 2)
      for (auto* f : {&mixed, &plain}) f->shard(second);
    torch::manual_seed(20 + step);
    for (size_t i = 0; i < pm.size(); ++i) {
      const auto g = torch::randn(pm[i].sizes()).to(torch::kBFloat16);
      pm[i].mutable_grad().copy_(g);
      pf[i].mutable_grad().copy_(g.to(torch::kFloat));
    }
    EXPECT_EQ(mixed.clip_grad_norm(0.5), plain.clip_grad_norm(0.5)) << "step " << step;
    mixed.step();
    plain.step();
    mixed.zero_grad();
    plain.zero_grad();
    for (size_t i = 0; i < pm.size(); ++i) EXPECT_TRUE(torch::equal(mixed.master_of(pm[i]), pf[i])) << "step " << step << " parameter " << i;
    mixed.refresh_compute();  // before the next forward: the next gradients are converted again
  }
  EXPECT_EQ(mixed.grad_bytes(), total * 2 + 275000 * 4);
}

// ... and converting a step's gradients touches only the windows' float32
// pages, not a whole float32 gradient.
TEST(FlatAdamW, ShardedBf16ConvertsOnlyTheHeldWindowsGradients) {
  constexpr int64_t n = 16 * 1024 * 1024;  // 64 MB as float32
  std::vector<torch::Tensor> p{torch::zeros({n}).requires_grad_(true)};
  flat_adamw_options o;
  o.compute = torch::kBFloat16;
  flat_adamw m(p, o);
  m.shard({{0, n / 8}});
  p[0].mutable_grad().fill_(0.5);  // a step's bf16 gradients, every page touched
  ASSERT_TRUE(testing::reset_peak());
  const int64_t before = testing::status_kb("VmRSS:");
  const double norm = m.clip_grad_norm(1e9);
  const int64_t added_kb = testing::status_kb("VmHWM:") - before;
  EXPECT_EQ(norm, std::sqrt(0.25 * static_cast<double>(n)));
  EXPECT_LT(added_kb, n * 4 / 1024 / 4) << "converting touched " << added_kb << " kB: the whole float32 gradient is " << n * 4 / 1024 << " kB";
  EXPECT_TRUE(torch::equal(m.grad_window(0, 64), torch::full({64}, 0.5)));
}

// zero_grad in mixed precision (zero 0 and 1) zeroes the bf16 gradients
// and marks the float32 ones stale instead of zeroing them too: the next
// step's gradients are converted again when read, with no refresh between.
TEST(FlatAdamW, Bf16ZeroGradLeavesTheNextGradientsToBeConverted) {
  for (bool sharded : {false, true}) {
    SCOPED_TRACE(sharded ? "sharded" : "whole");
    torch::manual_seed(8);
    std::vector<torch::Tensor> pm{torch::randn({4096}).requires_grad_(true)};
    std::vector<torch::Tensor> pf{pm[0].detach().clone().requires_grad_(true)};
    flat_adamw_options o;
    o.compute = torch::kBFloat16;
    flat_adamw mixed(pm, o), plain(pf, flat_adamw_options{});
    if (sharded)
      for (auto* f : {&mixed, &plain}) f->shard({{0, 4096}});
    for (int step = 0; step < 3; ++step) {
      const auto g = torch::randn({4096}).to(torch::kBFloat16);
      pm[0].mutable_grad().copy_(g);
      pf[0].mutable_grad().copy_(g.to(torch::kFloat));
      EXPECT_EQ(mixed.clip_grad_norm(0.5), plain.clip_grad_norm(0.5)) << "step " << step;
      mixed.step();
      plain.step();
      mixed.zero_grad();
      plain.zero_grad();
      EXPECT_TRUE(torch::equal(pm[0].grad(), torch::zeros({4096}, torch::kBFloat16)));
      EXPECT_TRUE(torch::equal(mixed.master_of(pm[0]), pf[0])) << "step " << step;
    }
  }
}

// keep_compute_once (healing in bf16 with sharded masters): the next
// refresh keeps the copies as they are, though the held window's masters
// say otherwise; the one after rounds them again; keep_compute_once(false)
// takes it back.
TEST(FlatAdamW, KeepComputeOnceSkipsOneRefreshOnly) {
  torch::manual_seed(9);
  std::vector<torch::Tensor> p{torch::randn({1024}).requires_grad_(true)};
  flat_adamw_options o;
  o.compute = torch::kBFloat16;
  o.held_masters_only = true;
  flat_adamw opt(p, o);
  opt.shard({{0, 1024}});
  opt.refresh_compute();
  const auto copies = p[0].detach().clone();
  torch::NoGradGuard no_grad;
  opt.master_of(p[0]).add_(1.0);  // masters that landed since (a move), not yet rounded
  opt.keep_compute_once();
  opt.refresh_compute();
  EXPECT_TRUE(torch::equal(p[0], copies));
  opt.refresh_compute();
  EXPECT_TRUE(torch::equal(p[0], opt.master_of(p[0]).to(torch::kBFloat16)));
  EXPECT_FALSE(torch::equal(p[0], copies));
  opt.master_of(p[0]).add_(1.0);
  opt.keep_compute_once();
  opt.keep_compute_once(false);
  opt.refresh_compute();
  EXPECT_TRUE(torch::equal(p[0], opt.master_of(p[0]).to(torch::kBFloat16)));
}

TEST(FlatAdamW, CheckpointResumesExactly) {
  auto n1 = make_net(9);
  flat_adamw f1(n1->parameters(), options());
  for (int64_t s = 0; s < 4; ++s) {
    backward_on(*n1, s);
    f1.step();
    f1.zero_grad();
  }
  const std::string state = save(f1);
  torch::serialize::OutputArchive mar;
  n1->save(mar);
  std::ostringstream ms(std::ios::binary);
  mar.save_to(ms);

  auto n2 = make_net(123);  // other initial values
  flat_adamw f2(n2->parameters(), options());
  torch::serialize::InputArchive min, oin;
  std::istringstream mi(ms.str(), std::ios::binary), oi(state, std::ios::binary);
  min.load_from(mi);
  n2->load(min);
  f2.rebind();
  oin.load_from(oi);
  f2.load(oin);
  EXPECT_EQ(f2.steps_taken(), 4);
  for (int64_t s = 4; s < 8; ++s) {
    backward_on(*n1, s);
    backward_on(*n2, s);
    f1.step();
    f1.zero_grad();
    f2.step();
    f2.zero_grad();
  }
  EXPECT_EQ(max_abs_diff(snapshot(*n1), snapshot(*n2)), 0.0);
  // The parameters are still the buffer's views after load + rebind.
  EXPECT_EQ(static_cast<float*>(n2->a->weight.data_ptr()) + n2->a->weight.numel(), static_cast<float*>(n2->b->weight.data_ptr()));
}

TEST(FlatAdamW, ReadsLibTorchAdamWStateOfOlderCheckpoints) {
  auto n1 = make_net(11), n2 = make_net(11);
  reference ref(*n1, options());
  for (int64_t s = 0; s < 5; ++s) {
    backward_on(*n1, s);
    ref.step(1e9);
  }
  torch::serialize::OutputArchive ar;
  ref.opt->save(ar);
  std::ostringstream os(std::ios::binary);
  ar.save_to(os);
  {
    torch::NoGradGuard ng;
    for (size_t i = 0; i < n1->parameters().size(); ++i) n2->parameters()[i].copy_(n1->parameters()[i]);
  }
  flat_adamw flat(n2->parameters(), options());
  torch::serialize::InputArchive in;
  std::istringstream is(os.str(), std::ios::binary);
  in.load_from(is);
  flat.load(in);
  EXPECT_EQ(flat.steps_taken(), 5);
  for (int64_t s = 5; s < 10; ++s) {
    backward_on(*n1, s);
    backward_on(*n2, s);
    ref.step(1e9);
    flat.step();
    flat.zero_grad();
  }
  EXPECT_LT(max_abs_diff(snapshot(*n1), snapshot(*n2)), 1e-6);
}

TEST(FlatAdamW, StateOfAnotherModelIsRefused) {
  auto small = make_net(1);
  flat_adamw f1(small->parameters(), options());
  const std::string state = save(f1);
  torch::manual_seed(2);
  auto other = torch::nn::Linear(4, 4);
  flat_adamw f2(other->parameters(), options());
  torch::serialize::InputArchive in;
  std::istringstream is(state, std::ios::binary);
  in.load_from(is);
  EXPECT_THROW(f2.load(in), c10::Error);
}

// The fused loop is vectorised (AVX-512/AVX2/baseline clones): whatever the
// width and wherever the tail starts, every element must get exactly the
// bits of the plain one-element-at-a-time formula, or ranks on different
// CPUs would drift apart.
TEST(AdamWKernel, EveryLengthMatchesTheScalarFormulaBitForBit) {
  adamw_scalars k{1 - 1e-3f * 0.05f, 0.9f, 0.1f, 0.999f, 0.001f, std::sqrt(1 - std::pow(0.999f, 7.0f)), 1e-8f, -1e-3f / (1 - std::pow(0.9f, 7.0f))};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t n : {1, 7, 15, 16, 17, 31, 33, 1000, 4099}) {
    std::vector<float> p(n), m(n), v(n), g(n);
    for (int64_t i = 0; i < n; ++i) {
      p[i] = normal(rng);
      m[i] = 0.1f * normal(rng);
      v[i] = 0.01f * std::fabs(normal(rng));
      g[i] = normal(rng);
    }
    g[0] = 0.f;  // a zero gradient with zero state divides 0 by eps
    v[0] = 0.f;
    m[0] = 0.f;
    auto p2 = p, m2 = m, v2 = v;
    adamw_update(p.data(), m.data(), v.data(), g.data(), n, k);
    for (int64_t i = 0; i < n; ++i) {
      volatile float mi = m2[i] * k.beta1 + k.one_minus_beta1 * g[i];  // volatile: no contraction, no reordering
      volatile float vi = v2[i] * k.beta2 + k.one_minus_beta2 * g[i] * g[i];
      volatile float denom = std::sqrt(static_cast<float>(vi)) / k.sqrt_bias_correction2 + k.eps;
      volatile float pi = p2[i] * k.decay_factor + k.neg_step_size * mi / denom;
      ASSERT_EQ(std::memcmp(&p[i], (const void*)&pi, sizeof(float)), 0) << "n=" << n << " element " << i << ": " << p[i] << " vs " << pi;
      ASSERT_EQ(m[i], static_cast<float>(mi)) << "n=" << n << " element " << i;
      ASSERT_EQ(v[i], static_cast<float>(vi)) << "n=" << n << " element " << i;
    }
  }
}

// The gradient norm's ranges: chunks of a size that depends on the model's
// size only, cut at group bases, at most max_norm_chunks + groups of them;
// every shard of every world begins and ends at a range boundary, so a rank
// holding shards computes whole ranges.
TEST(GradNorm, ShardBoundariesAreTheNormsRangeBoundariesAtEveryWorld) {
  for (int64_t total : {int64_t{0}, int64_t{1}, int64_t{100}, int64_t{12345}, int64_t{1} << 20, int64_t{202'000'001}}) {
    const std::vector<int64_t> bases = {0, total / 3, total / 3 + 7};
    const auto rs = norm_ranges(total, bases);
    EXPECT_LE(static_cast<int64_t>(rs.size()), max_norm_chunks + 2) << total;
    EXPECT_EQ(norm_chunk(total) % 64, 0);
    std::set<int64_t> starts;
    int64_t at = 0;
    for (const auto& [a, b] : rs) {
      EXPECT_EQ(a, at);
      EXPECT_LT(a, b);
      at = b;
      starts.insert(a);
    }
    EXPECT_EQ(at, total);
    for (int64_t b : bases)
      EXPECT_TRUE(b >= total || starts.count(b)) << "group base " << b;
    for (int world = 1; world <= 9; ++world) {
      const auto p = make_shard_plan(total, std::vector<std::string>(static_cast<size_t>(world), "a"), 2);
      for (const auto& sh : p.shards) {
        if (sh.begin == sh.end) continue;
        EXPECT_TRUE(starts.count(sh.begin)) << "world " << world << ": a shard begins at " << sh.begin << ", inside a range";
        EXPECT_TRUE(sh.end == total || starts.count(sh.end)) << "world " << world << ": a shard ends at " << sh.end << ", inside a range";
        const auto [first, last] = ranges_within(rs, sh.begin, sh.end);
        EXPECT_EQ(rs[first].first, sh.begin);
        EXPECT_EQ(rs[last - 1].second, sh.end);
      }
    }
  }
}

// A range's sum of squares is one fixed order of double additions:
// the same bits from the float values and from their double copies, and
// from a copy at another address.
TEST(GradNorm, TheSumOfSquaresDependsOnTheValuesOnly) {
  torch::manual_seed(3);
  const auto x = torch::randn({1001});
  const auto y = x.clone(), d = x.to(torch::kDouble);
  const double a = sum_squares(x.data_ptr<float>(), x.numel());
  EXPECT_EQ(a, sum_squares(y.data_ptr<float>(), y.numel()));
  EXPECT_EQ(a, sum_squares(d.data_ptr<double>(), d.numel()));
  EXPECT_NEAR(a, d.pow(2).sum().item<double>(), 1e-12 * a);
  EXPECT_EQ(norm_of_parts({a, 0.0, 2.0}), std::sqrt(a + 0.0 + 2.0));
}

// bf16 values summed by their bits: the sum of the float32 values they widen to.
TEST(GradNorm, Bf16SumsOfSquaresAreThoseOfTheirFloat32Values) {
  torch::manual_seed(4);
  const auto b = torch::randn({1003}).to(torch::kBFloat16);
  const auto f = b.to(torch::kFloat);
  const double want = sum_squares(f.data_ptr<float>(), f.numel());
  EXPECT_EQ(sum_squares_bf16(reinterpret_cast<const uint16_t*>(b.data_ptr<c10::BFloat16>()), b.numel()), want);
  EXPECT_GT(want, 0.0);
}

}  // namespace
}  // namespace dtactor
