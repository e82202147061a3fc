#include "comm/grad_sync.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "model/trainer.hpp"
#include "rank_threads.hpp"
#include "comm/communicator.hpp"
#include "base/process.hpp"
#include "comm/shm_group.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

grad_sync_options bucket_of(int64_t bytes) {
  grad_sync_options o;
  o.bucket_bytes = bytes;
  return o;
}

using testing::tiny_vit_config;

step_control ctl(float newer_plan, float stop, float final_checkpoint = 0.f) {
  step_control c;
  c.newer_plan = newer_plan;
  c.stop = stop;
  c.final_checkpoint = final_checkpoint;
  return c;
}
std::vector<float> words(const step_control& c) { return {c.newer_plan, c.stop, c.final_checkpoint}; }

using testing::make_states;
using testing::run_ranks;
using testing::run_ranks_shm;
using testing::run_on_hosts;

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}

std::vector<torch::Tensor> params_of(training_state& s) { return s.the_task().module()->parameters(); }

int64_t gradient_floats(training_state& s) {
  int64_t n = 0;
  for (auto& p : params_of(s)) n += p.numel();
  return n;
}

std::vector<torch::Tensor> single_process_gradients(training_state& s) {
  s.forward_backward(s.order().global_batch(s.step()), s.step());
  std::vector<torch::Tensor> g;
  for (auto& t : s.gradients()) g.push_back(t.clone());
  return g;
}

// "" when every gradient of `s` matches `want`.
std::string compare_gradients(training_state& s, const std::vector<torch::Tensor>& want) {
  auto got = s.gradients();
  if (got.size() != want.size()) return "parameter count differs";
  for (size_t i = 0; i < got.size(); ++i) {
    if (!got[i].defined()) return "gradient " + std::to_string(i) + " undefined";
    if (!torch::allclose(got[i], want[i], 1e-4, 1e-6))
      return "gradient " + std::to_string(i) + " differs by " + std::to_string((got[i] - want[i]).abs().max().item<double>());
  }
  return "";
}

TEST(GradSync, OneStepEqualsSingleProcessGradient) {
  const int world = 3;  // 32 samples over 3 ranks: slices of 11, 11, 10
  auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
  auto states = make_states(cfg, world + 1);
  const auto want = single_process_gradients(*states[world]);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    grad_sync sync(params_of(s), pg, bucket_of(4 * 1024));
    s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
    auto t = sync.finish();
    if (!t) return t.message();
    if (t->buckets < 2) return "expected several buckets";
    return compare_gradients(s, want);
  }));
}

TEST(GradSync, TrainingStepsMatchSingleProcessAndRanksAgree) {
  const int world = 2, steps = 5;
  auto cfg = tiny_vit_config();
  auto states = make_states(cfg, world + 1);
  auto& ref = *states[world];
  for (int i = 0; i < steps; ++i) testing::train_alone(ref);
  std::vector<std::string> digests(world);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    grad_sync sync(params_of(s), pg, bucket_of(16 * 1024));
    for (int i = 0; i < steps; ++i) {
      auto r = s.train_step(step_context::every_step(rank, world, sync));
      if (!r) return r.message();
      if (r->samples != 16) return "rank slice of " + std::to_string(r->samples) + " samples";
    }
    digests[rank] = s.params_digest();
    return s.step() == steps ? "" : "step() did not advance";
  }));
  EXPECT_EQ(digests[0], digests[1]);
  // Gradients agree to float rounding (see above), but AdamW's first steps
  // move an element by about lr * sign(gradient), so an element whose
  // gradient is rounding noise may move the other way: bound the worst
  // element by the step sizes taken and the typical one tightly.
  auto a = params_of(*states[0]), b = params_of(ref);
  double worst = 0, total = 0;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    auto d = (a[i] - b[i]).abs();
    worst = std::max(worst, d.max().item<double>());
    total += d.sum().item<double>();
    n += d.numel();
  }
  EXPECT_LT(worst, 2 * steps * cfg.get_double("train.lr"));
  EXPECT_LT(total / static_cast<double>(n), 1e-6);
}

TEST(GradSync, MicroBatchAccumulationGivesTheSameGradient) {
  const int world = 2;
  auto cfg = tiny_vit_config({"train.micro_batch_size=5"});  // 16 per rank: 5+5+5+1
  auto states = make_states(cfg, world + 1);
  const auto want = single_process_gradients(*states[world]);
  std::vector<int> launched_before_finish(world, -1);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    grad_sync sync(params_of(s), pg, bucket_of(2 * 1024));
    for (int step = 0; step < 2; ++step) {  // twice: state resets between steps
      s.the_task().module()->zero_grad();
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
      launched_before_finish[rank] = sync.launched();
      auto t = sync.finish();
      if (!t) return t.message();
      if (auto e = compare_gradients(s, want); !e.empty()) return e;
    }
    return "";
  }));
  // Only the last micro-batch's backward launched, and it launched everything.
  for (int r = 0; r < world; ++r) EXPECT_GT(launched_before_finish[r], 0);
}

TEST(GradSync, WorldOfOneNeedsNoGroupAndMatchesTrainStep) {
  auto cfg = tiny_vit_config({"train.micro_batch_size=12"});
  auto states = make_states(cfg, 2);
  grad_sync sync(params_of(*states[0]), {}, grad_sync_options{});
  EXPECT_EQ(sync.world(), 1);
  EXPECT_EQ(sync.bucket_count(), 0u);
  for (int i = 0; i < 4; ++i) {
    auto r = states[0]->train_step(step_context::every_step(0, 1, sync));
    ASSERT_TRUE(r) << r.message();
    EXPECT_EQ(r->samples, 32);
    EXPECT_EQ(r->buckets, 0);
    testing::train_alone(*states[1]);
  }
  EXPECT_EQ(states[0]->params_digest(), states[1]->params_digest());
}

TEST(GradSync, BucketCountFollowsBucketSizeAndAllreduceOverlapsBackward) {
  const int world = 2;
  auto cfg = tiny_vit_config();
  auto states = make_states(cfg, world);
  const size_t n_params = params_of(*states[0]).size();
  std::vector<size_t> small_buckets(world), huge_buckets(world);
  std::vector<int> seen_during_backward(world, 0);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    auto params = params_of(s);
    {
      grad_sync huge(params, pg, bucket_of(int64_t{1} << 30));
      huge_buckets[rank] = huge.bucket_count();
    }
    grad_sync sync(params, pg, bucket_of(1024));
    small_buckets[rank] = sync.bucket_count();
    // Buckets hold whole parameters in reverse order; each but the last is
    // closed by the parameter that brought it to 1 KB or more.
    size_t expect_next = params.size();
    const auto layout = sync.bucket_layout();
    for (size_t k = 0; k < layout.size(); ++k) {
      int64_t bytes = 0, last = 0;
      for (size_t i : layout[k]) {
        if (i != --expect_next) return "bucket layout is not reverse parameter order";
        last = params[i].numel() * static_cast<int64_t>(params[i].element_size());
        bytes += last;
      }
      if (k + 1 < layout.size() && (bytes < 1024 || bytes - last >= 1024)) return "bucket " + std::to_string(k) + " has the wrong size";
    }
    // A gradient hook on each parameter sees how many buckets were already on
    // the wire while backward was still computing gradients.
    int& seen = seen_during_backward[rank];
    std::vector<std::pair<torch::Tensor, unsigned>> handles;
    for (auto& p : params) handles.emplace_back(p, p.register_hook([&seen, &sync](const torch::Tensor&) { seen = std::max(seen, sync.launched()); }));
    s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
    for (auto& [p, h] : handles) p.remove_hook(h);
    auto t = sync.finish();
    if (!t) return t.message();
    if (t->launched_in_backward != t->buckets) return "not every bucket was launched during backward";
    if (!(t->allreduce_s > 0) || t->exposed_s < 0) return "timing not measured";
    return "";
  }));
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(huge_buckets[r], 1u);
    EXPECT_GE(small_buckets[r], 5u);  // the tiny ViT holds about 8 KB of parameters
    EXPECT_LT(small_buckets[r], n_params);
    EXPECT_GT(seen_during_backward[r], 0);
  }
}

// step_control is copied into the bucket as raw floats: its layout is its
// fields in declaration order, one float each, as step_control::words says.
TEST(GradSync, StepControlLayoutIsItsFieldsInOrder) {
  EXPECT_EQ(offsetof(step_control, newer_plan), 0 * sizeof(float));
  EXPECT_EQ(offsetof(step_control, stop), 1 * sizeof(float));
  EXPECT_EQ(offsetof(step_control, final_checkpoint), 2 * sizeof(float));
  EXPECT_EQ(offsetof(step_control, writer_busy), 3 * sizeof(float));
  EXPECT_EQ(sizeof(step_control), static_cast<size_t>(step_control::words) * sizeof(float));
  // The decisions on the world's sums.
  EXPECT_TRUE(ctl(3.f, 0.f).all_hold_newer_plan(3));
  EXPECT_FALSE(ctl(2.f, 0.f).all_hold_newer_plan(3));
  EXPECT_TRUE(ctl(0.f, 1.f).stop_agreed());
  EXPECT_FALSE(ctl(0.f, 0.f, 1.f).stop_agreed());
  EXPECT_TRUE(ctl(0.f, 2.f, 1.f).final_checkpoint_wanted());
  step_control busy;
  EXPECT_FALSE(busy.some_writer_busy());
  busy.writer_busy = 1.f;
  EXPECT_TRUE(busy.some_writer_busy());
}

// 4 KB buckets, the step's control words carried in the first.
grad_sync_options control_options() {
  grad_sync_options o;
  o.bucket_bytes = 4 * 1024;
  o.carry_control = true;
  return o;
}

// The control word rides with the first bucket: every rank reads the same
// sums of what each set, over several steps, and the gradients are unchanged.
TEST(GradSync, ControlWordIsSummedWithTheFirstBucket) {
  const int world = 3;
  auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
  auto states = make_states(cfg, world + 1);
  const auto want = single_process_gradients(*states[world]);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    grad_sync sync(params_of(s), pg, control_options());
    for (int step = 0; step < 3; ++step) {
      sync.set_control(ctl(static_cast<float>(rank + step), rank == 1 && step == 2 ? 1.f : 0.f, rank == 2 ? 0.25f * static_cast<float>(step) : 0.f));
      s.zero_grad();
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
      auto t = sync.finish();
      if (!t) return t.message();
      const auto c = words(sync.control());
      if (c != std::vector<float>{static_cast<float>(3 + 3 * step), step == 2 ? 1.f : 0.f, 0.25f * static_cast<float>(step)})
        return "step " + std::to_string(step) + ": control sums " + std::to_string(c[0]) + ", " + std::to_string(c[1]) + ", " + std::to_string(c[2]);
      if (auto e = compare_gradients(s, want); !e.empty()) return e;
    }
    return "";
  }));
  // A world of one reads back its own word; so does a group with no parameters.
  grad_sync_options o;
  o.carry_control = true;
  grad_sync alone(params_of(*states[0]), c10::intrusive_ptr<c10d::ProcessGroup>(), o);
  alone.set_control(ctl(4.f, 1.f));
  ASSERT_TRUE(alone.finish());
  EXPECT_EQ(words(alone.control()), (std::vector<float>{4.f, 1.f, 0.f}));
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    grad_sync none({}, pg, o);
    none.set_control(ctl(1.f, static_cast<float>(rank)));
    auto t = none.finish();
    if (!t) return t.message();
    return words(none.control()) == std::vector<float>{2.f, 1.f, 0.f} ? "" : "no-parameter control word not summed";
  }));
}

// A control source is read when the first bucket is launched, in backward:
// a plan that arrives after the step began (after set_control) is in this
// step's sums, so every rank switches one step earlier. A world of one reads
// it at finish().
TEST(GradSync, ControlSourceIsReadWhenTheFirstBucketIsLaunched) {
  const int world = 2;
  auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
  auto states = make_states(cfg, world);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    grad_sync sync(params_of(s), pg, control_options());
    bool plan_arrived = false, finishing = false;
    int read_in_backward = 0, read_in_finish = 0;
    sync.set_control_source([&] {
      ++(finishing ? read_in_finish : read_in_backward);
      return ctl(plan_arrived ? 1.f : 0.f, 0.f);
    });
    for (int step = 0; step < 2; ++step) {
      sync.set_control(ctl(0.f, 0.f));  // the step starts with no newer plan
      plan_arrived = step == 1;         // one arrives during step 1's forward pass
      finishing = false;
      s.zero_grad();
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
      finishing = true;
      auto t = sync.finish();
      if (!t) return t.message();
      const float want = step == 1 ? static_cast<float>(world) : 0.f;
      if (sync.control().newer_plan != want)
        return "step " + std::to_string(step) + ": newer_plan summed to " + std::to_string(sync.control().newer_plan) + ", want " + std::to_string(want);
    }
    if (read_in_backward != 2 || read_in_finish != 0)
      return "the source was read " + std::to_string(read_in_backward) + " times in backward and " + std::to_string(read_in_finish) + " in finish, want 2 and 0";
    return "";
  }));
  grad_sync_options o;
  o.carry_control = true;
  grad_sync alone(params_of(*states[0]), c10::intrusive_ptr<c10d::ProcessGroup>(), o);
  alone.set_control(ctl(0.f, 0.f));
  alone.set_control_source([] { return ctl(1.f, 1.f); });
  ASSERT_TRUE(alone.finish());
  EXPECT_EQ(words(alone.control()), (std::vector<float>{1.f, 1.f, 0.f}));
}

// cluster.wire_dtype = bf16: every rank ends with the same gradient (bit
// for bit). At 2 ranks (all-gather) it is the sum of the ranks' gradients
// each rounded to bf16, added in fp32; from 3 ranks on (reduce-scatter,
// then all-gather of the shards) that sum rounded to bf16 once more. So
// within bf16 rounding of the exact fp32 result; control words arrive
// exact, and steps keep the ranks equal.
TEST(GradSync, Bf16WireRoundsEachRanksGradientOnceAndRanksAgree) {
  for (const int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
    auto states = make_states(cfg, world + 1);
    const auto exact = single_process_gradients(*states[world]);
    // The reference: each rank's own gradient, rounded to bf16, summed in fp32 in rank order.
    std::vector<std::vector<torch::Tensor>> own(world), own_fp32(world);
    {
      auto ref = make_states(cfg, 1);
      for (int r = 0; r < world; ++r) {
        ref[0]->zero_grad();
        ref[0]->forward_backward(ref[0]->order().rank_slice(0, r, world), 0, r);
        for (auto& g : ref[0]->gradients()) {
          own[r].push_back(g.to(torch::kBFloat16).to(torch::kFloat));
          own_fp32[r].push_back(g.clone());
        }
      }
    }
    std::vector<std::vector<torch::Tensor>> got(world);
    expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
      auto& s = *states[rank];
      grad_sync_options o;
      o.bucket_bytes = 4 * 1024;
      o.carry_control = true;
      o.exchange.codec = wire_codec::bf16;
      grad_sync sync(params_of(s), pg, o);
      sync.set_control(ctl(1000.f + static_cast<float>(rank), 0.125f * static_cast<float>(rank + 1)));
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
      auto t = sync.finish();
      if (!t) return t.message();
      if (t->buckets < 2) return "expected several buckets";
      // 1000 * world + 0..world-1 and 0.125 * (1..world) summed: 3003 and
      // 0.75 at 3 ranks are not bf16 numbers: the control words went as fp32.
      const float c0 = 1000.f * static_cast<float>(world) + static_cast<float>(world * (world - 1) / 2);
      const float c1 = 0.125f * static_cast<float>(world * (world + 1) / 2);
      if (words(sync.control()) != std::vector<float>{c0, c1, 0.f})
        return "control sums " + std::to_string(sync.control().newer_plan) + ", " + std::to_string(sync.control().stop);
      for (auto& g : s.gradients()) got[rank].push_back(g.clone());
      return "";
    }));
    ASSERT_EQ(got[0].size(), exact.size());
    for (size_t i = 0; i < exact.size(); ++i) {
      auto want = own[0][i].clone();
      auto magnitude = own[0][i].abs();
      auto fp32_sum = own_fp32[0][i].clone();
      for (int r = 1; r < world; ++r) {
        want += own[r][i];
        magnitude += own[r][i].abs();
        fp32_sum += own_fp32[r][i];
      }
      if (world >= 3) want = want.to(torch::kBFloat16).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(got[0][i], want)) << "gradient " << i << " is not the fp32 sum of the bf16-rounded ones"
                                                 << (world >= 3 ? ", rounded to bf16" : "");
      for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(got[0][i], got[r][i])) << "rank " << r << " differs, gradient " << i;
      // bf16 keeps 8 bits of mantissa: each rank's part is within 2^-8 of its
      // value (and the reduce-scatter's sum within 2^-8 of itself), so the
      // result is within 2^-8 (2^-7) of the sum of the parts' magnitudes.
      auto bound = magnitude * ((world >= 3 ? 2.02 : 1.01) / 256) + 1e-9;
      EXPECT_TRUE(((got[0][i] - fp32_sum).abs() <= bound).all().item<bool>()) << "gradient " << i;
      EXPECT_TRUE(torch::allclose(fp32_sum, exact[i], 1e-4, 1e-6)) << "gradient " << i;
    }
  }
  const int world = 3;
  // Training steps over the bf16 wire keep every rank's parameters equal.
  auto again = make_states(tiny_vit_config(), world);
  std::vector<std::string> digests(world);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *again[rank];
    grad_sync_options o = bucket_of(16 * 1024);
    o.exchange.codec = wire_codec::bf16;
    grad_sync sync(params_of(s), pg, o);
    for (int i = 0; i < 5; ++i)
      if (auto r = s.train_step(step_context::every_step(rank, world, sync)); !r) return r.message();
    digests[rank] = s.params_digest();
    return "";
  }));
  EXPECT_EQ(digests[0], digests[1]);
  EXPECT_EQ(digests[0], digests[2]);
}

// Rank 0 uses p and q, rank 1 only p, nobody uses u: p and q get the sums, u
// keeps no gradient with find_unused_parameters (and a zero one without).
// Also with finish() polling instead of sleeping (spin_wait): same sums.
TEST(GradSync, UnusedParameters) {
  for (auto [find_unused, spin_us] : std::vector<std::pair<bool, int>>{{true, 0}, {false, 0}, {true, 20000}, {false, 20000}}) {
    expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
      auto p = torch::zeros({3}, torch::requires_grad()), q = torch::zeros({2}, torch::requires_grad()),
           u = torch::zeros({4}, torch::requires_grad());
      grad_sync_options o;
      o.bucket_bytes = 8;
      o.find_unused_parameters = find_unused;
      o.spin_wait = std::chrono::microseconds(spin_us);
      grad_sync sync({p, q, u}, pg, o);
      for (int step = 0; step < 2; ++step) {
        for (auto* t : {&p, &q, &u})
          if (t->grad().defined()) t->mutable_grad().zero_();
        sync.arm();
        auto loss = rank == 0 ? (p * 1).sum() + (q * 2).sum() : (p * 3).sum();
        loss.backward();
        auto t = sync.finish();
        if (!t) return t.message();
        if (!torch::equal(p.grad(), torch::full({3}, 4.f))) return "p gradient wrong";
        if (!torch::equal(q.grad(), torch::full({2}, 2.f))) return "q gradient wrong";
        if (find_unused && u.grad().defined()) return "u got a gradient";
        if (!find_unused && !torch::equal(u.grad(), torch::zeros({4}))) return "u gradient not zero";
      }
      return "";
    }));
  }
}

// A peer that never joins the allreduce: finish() reports it within its
// timeout instead of throwing or hanging, and refuses later steps.
// Polling (spin_wait far beyond the timeout) ends at the deadline too.
TEST(GradSync, TimeoutIsAStatus) {
  for (int spin_us : {0, 10000000}) {
    auto errors = run_ranks(
        2,
        [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
          if (rank == 1) {
            std::this_thread::sleep_for(std::chrono::milliseconds(400));
            return "";  // leaves without reducing; its group closes the connection
          }
          auto p = torch::ones({8}, torch::requires_grad());
          grad_sync_options o;
          o.timeout = std::chrono::milliseconds(150);
          o.spin_wait = std::chrono::microseconds(spin_us);
          grad_sync sync({p}, pg, o);
          sync.arm();
          (p * 2).sum().backward();
          const auto t0 = std::chrono::steady_clock::now();
          auto t = sync.finish();
          const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (t) return "finish() succeeded without the peer";
          if (waited > 1.0) return "finish() waited " + std::to_string(waited) + " s";
          if (sync.finish()) return "a second finish() succeeded";
          return "";
        },
        std::chrono::milliseconds(1500));
    expect_no_errors(errors);
  }
}

// A newer generation abandons the step: a wait that is still polling
// (spin_wait of 10 s, timeout 30 s) notices within milliseconds.
TEST(GradSync, AbandonEndsAPollingWait) {
  std::atomic<bool> give_up{false};
  auto errors = run_ranks(
      2,
      [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
        if (rank == 1) {
          while (!give_up.load()) std::this_thread::yield();  // never joins the allreduce
          return "";
        }
        auto p = torch::ones({8}, torch::requires_grad());
        grad_sync_options o;
        o.timeout = std::chrono::milliseconds(30000);
        o.spin_wait = std::chrono::microseconds(10000000);
        const auto t0 = std::chrono::steady_clock::now();
        o.abandon = [&] { return std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(100); };
        grad_sync sync({p}, pg, o);
        sync.arm();
        (p * 2).sum().backward();
        auto t = sync.finish();
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        give_up = true;
        if (t) return "finish() succeeded without the peer";
        if (t.message().find("abandoned") == std::string::npos) return "not abandoned: " + t.message();
        if (waited > 2.0) return "finish() waited " + std::to_string(waited) + " s";
        return "";
      },
      std::chrono::milliseconds(1500));
  expect_no_errors(errors);
}

// `steps` steps of 3 ranks through shared memory (buckets of `bucket_kb`,
// slots of slot_floats(the state) floats): every rank's gradients are one
// process's, the control word is summed, and the ranks' gradients are
// bit-identical (each sums the regions in rank order).
void expect_shm_matches_single_process(int bucket_kb, const std::function<int64_t(training_state&)>& slot_floats, int steps) {
  const int world = 3;
  auto cfg = tiny_vit_config({"cluster.bucket_kb=" + std::to_string(bucket_kb)});
  auto states = make_states(cfg, world + 1);
  const auto want = single_process_gradients(*states[world]);
  std::vector<std::vector<torch::Tensor>> got(world);
  expect_no_errors(run_ranks_shm(world, slot_floats(*states[0]),
                                 [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) -> std::string {
                                   auto& s = *states[rank];
                                   grad_sync_options o;
                                   o.bucket_bytes = bucket_kb * 1024;
                                   o.carry_control = true;
                                   o.exchange.transport = exchange_transport::shared_memory;
                                   o.shm = shm;
                                   grad_sync sync(params_of(s), pg, o);
                                   if (!sync.uses_shm()) return "shared memory not used";
                                   for (int step = 0; step < steps; ++step) {
                                     sync.set_control(ctl(static_cast<float>(rank + step), 0.f));
                                     s.zero_grad();
                                     s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
                                     if (sync.launched() < 2) return "buckets were not published during backward";
                                     auto t = sync.finish();
                                     if (!t) return t.message();
                                     if (t->buckets < 2) return "expected several buckets";
                                     if (sync.control().newer_plan != static_cast<float>(3 + 3 * step)) return "control word not summed";
                                     if (auto e = compare_gradients(s, want); !e.empty()) return "step " + std::to_string(step) + ": " + e;
                                   }
                                   for (auto& g : s.gradients()) got[rank].push_back(g.clone());
                                   return "";
                                 }));
  for (int r = 1; r < world; ++r)
    for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(torch::equal(got[0][i], got[r][i])) << "rank " << r << " gradient " << i;
}

// Ranks on one host exchange buckets through shared memory, slots of a step.
TEST(GradSync, SharedMemoryMatchesSingleProcessAndRanksAreIdentical) {
  expect_shm_matches_single_process(4, [](training_state& s) { return gradient_floats(s) + step_control::words; }, 3);
}

// Whole training steps over shared memory keep the ranks' parameters equal.
TEST(GradSync, SharedMemoryTrainingStepsKeepRanksEqual) {
  const int world = 2, steps = 5;
  auto cfg = tiny_vit_config();
  auto states = make_states(cfg, world);
  std::vector<std::string> digests(world);
  expect_no_errors(run_ranks_shm(world, gradient_floats(*states[0]),
                                 [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) -> std::string {
                                   auto& s = *states[rank];
                                   grad_sync_options o;
                                   o.bucket_bytes = 16 * 1024;
                                   o.exchange.transport = exchange_transport::shared_memory;
                                   o.shm = shm;
                                   grad_sync sync(params_of(s), pg, o);
                                   for (int i = 0; i < steps; ++i)
                                     if (auto r = s.train_step(step_context::every_step(rank, world, sync)); !r) return r.message();
                                   digests[rank] = s.params_digest();
                                   return "";
                                 }));
  EXPECT_EQ(digests[0], digests[1]);
  EXPECT_FALSE(digests[0].empty());
}

// A group whose slot cannot hold the largest bucket is not used: the
// process group carries them (same result). (A slot of 4 floats is 16: its
// size rounded up to 64 bytes.)
TEST(GradSync, SharedMemoryTooSmallFallsBackToTheGroup) {
  expect_no_errors(run_ranks_shm(2, 4, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) -> std::string {
    if (shm->capacity() != 16) return "a slot of " + std::to_string(shm->capacity()) + " floats";
    auto p = torch::zeros({40}, torch::requires_grad());
    grad_sync_options o;
    o.exchange.transport = exchange_transport::shared_memory;
    o.shm = shm;
    grad_sync sync({p}, pg, o);
    if (sync.uses_shm()) return "a bucket of 40 floats went into a 16-float slot";
    sync.arm();
    (p * static_cast<float>(rank + 1)).sum().backward();
    if (auto t = sync.finish(); !t) return t.message();
    return torch::equal(p.grad(), torch::full({40}, 3.f)) ? "" : "wrong sum";
  }));
}

// A rank that maps a segment of another shape: nobody uses shared memory,
// and every rank is told why (the same answer everywhere).
grad_sync_options options_for(const exchange_plan& p, int64_t bucket_bytes) {
  grad_sync_options o;
  o.bucket_bytes = bucket_bytes;
  o.exchange.transport = transport_for({exchange_transport::shared_memory, wire_codec::fp32}, p);
  o.shm = p.shm;
  o.hosts = p.hosts;
  return o;
}

TEST(GradSync, HostsAreGroupedByKeyInRankOrder) {
  EXPECT_EQ(group_by_host({"a", "a", "b", "b"}), (std::vector<std::vector<int>>{{0, 1}, {2, 3}}));
  EXPECT_EQ(group_by_host({"b", "a", "b", "c"}), (std::vector<std::vector<int>>{{0, 2}, {1}, {3}}));
  EXPECT_EQ(group_by_host({"a"}), (std::vector<std::vector<int>>{{0}}));
  // This process's own key names its machine, its host name and its network namespace.
  EXPECT_NE(host_key().find(net_namespace()), std::string::npos) << host_key();
}

// sum_slots adds in a pairwise tree over the sources' order.
TEST(GradSync, SumSlotsAddsInAPairwiseTree) {
  std::vector<torch::Tensor> scratch;
  // Values whose sum depends on the order of the additions in float32.
  std::vector<torch::Tensor> s{torch::tensor({1e8f}), torch::tensor({1.f}), torch::tensor({-1e8f}), torch::tensor({1.f}), torch::tensor({3.f})};
  auto out = torch::zeros({1});
  sum_slots(out, {s[0], s[1], s[2], s[3]}, scratch);
  EXPECT_EQ(out.item<float>(), ((1e8f + 1.f) + (-1e8f + 1.f)));
  sum_slots(out, s, scratch);
  EXPECT_EQ(out.item<float>(), ((1e8f + 1.f) + (-1e8f + 1.f)) + 3.f);
  sum_slots(out, {s[0], s[1], s[2]}, scratch);
  EXPECT_EQ(out.item<float>(), (1e8f + 1.f) + -1e8f);
}

// Where the ranks are decides the exchange: one host, a host each, or a mix.
TEST(GradSync, SetupExchangeFollowsWhereTheRanksAre) {
  std::vector<exchange_plan> plans(4);
  auto record = [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup>, const exchange_plan& p) -> std::string {
    plans[static_cast<size_t>(rank)] = p;
    return "";
  };
  expect_no_errors(run_on_hosts({"h", "h", "h", "h"}, 64, record));
  for (auto& p : plans) {
    EXPECT_FALSE(p.hierarchical);
    ASSERT_TRUE(p.shm);
    EXPECT_EQ(p.shm->world(), 4);
    EXPECT_EQ(p.describe("gloo"), "gradients over shared memory");
  }
  plans.assign(3, {});
  expect_no_errors(run_on_hosts({"a", "b", "c"}, 64, record));
  for (auto& p : plans) {
    EXPECT_FALSE(p.hierarchical);
    EXPECT_FALSE(p.shm);
    EXPECT_EQ(p.host_count, 3);
    EXPECT_NE(p.describe("gloo").find("gradients over gloo (no shared memory: every rank on a host of its own"), std::string::npos)
        << p.describe("gloo");
  }
  plans.assign(5, {});
  expect_no_errors(run_on_hosts({"a", "a", "b", "b", "b"}, 64, record));
  for (int r = 0; r < 5; ++r) {
    const auto& p = plans[static_cast<size_t>(r)];
    EXPECT_TRUE(p.hierarchical);
    EXPECT_EQ(p.host_count, 2);
    ASSERT_TRUE(p.shm);
    EXPECT_EQ(p.shm->world(), r < 2 ? 2 : 3);
    EXPECT_EQ(p.shm->rank(), r < 2 ? r : r - 2);
    // Only each host's first rank is in the group of hosts.
    EXPECT_EQ(static_cast<bool>(p.hosts), r == 0 || r == 2) << "rank " << r;
    if (p.hosts) {
      EXPECT_EQ(p.hosts->getSize(), 2);
    }
    EXPECT_NE(p.describe("gloo").find("within the host (" + std::to_string(p.shm->world()) + " ranks) and gloo across 2 hosts"), std::string::npos);
  }
}

// 2 hosts x 2 ranks, hierarchical: the gradient of the global batch on every
// rank, bit for bit the same as one host of 4 ranks over shared memory (the
// same additions in the same order), control words summed; also a host of
// one rank beside a host of two.
TEST(GradSync, HierarchicalTwoHostsOfTwoEqualOneHostOfFourBitForBit) {
  const int world = 4;
  auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
  auto states = make_states(cfg, 2 * world + 1);
  const auto want = single_process_gradients(*states[2 * world]);
  const int64_t floats = gradient_floats(*states[0]) + step_control::words;
  auto run = [&](const std::vector<std::string>& keys, int first_state, bool expect_hier) {
    const int w = static_cast<int>(keys.size());
    std::vector<std::vector<torch::Tensor>> got(w);
    expect_no_errors(run_on_hosts(keys, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& p) -> std::string {
      auto& s = *states[first_state + rank];
      auto o = options_for(p, 4 * 1024);
      o.carry_control = true;
      grad_sync sync(params_of(s), pg, o);
      if (sync.hierarchical() != expect_hier) return "hierarchical: " + std::to_string(sync.hierarchical());
      for (int step = 0; step < 3; ++step) {
        sync.set_control(ctl(static_cast<float>(rank + step), 1.f));
        s.zero_grad();
        s.forward_backward(s.order().rank_slice(0, rank, w), 0, rank, &sync);
        auto t = sync.finish();
        if (!t) return t.message();
        if (t->buckets < 2) return "expected several buckets";
        const float ranks_sum = static_cast<float>(w * (w - 1) / 2 + w * step);
        if (words(sync.control()) != std::vector<float>{ranks_sum, static_cast<float>(w), 0.f}) return "control words not summed";
        if (auto e = compare_gradients(s, want); !e.empty()) return "step " + std::to_string(step) + ": " + e;
      }
      for (auto& g : s.gradients()) got[rank].push_back(g.clone());
      return "";
    }));
    return got;
  };
  const auto one_host = run({"h", "h", "h", "h"}, 0, false);
  const auto two_hosts = run({"a", "a", "b", "b"}, world, true);
  ASSERT_EQ(one_host.size(), 4u);
  ASSERT_EQ(two_hosts.size(), 4u);
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(two_hosts[r].size(), one_host[0].size()) << "rank " << r;
    for (size_t i = 0; i < one_host[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(two_hosts[r][i], one_host[0][i])) << "rank " << r << " gradient " << i << " differs from one host's";
      EXPECT_TRUE(torch::equal(one_host[r][i], one_host[0][i])) << "rank " << r << " gradient " << i;
    }
  }
  // A host of one rank beside a host of two (world 3): the global gradient on every rank.
  auto uneven = make_states(cfg, 3);
  expect_no_errors(
      run_on_hosts({"a", "b", "b"}, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& p) -> std::string {
        auto& s = *uneven[rank];
        grad_sync sync(params_of(s), pg, options_for(p, 4 * 1024));
        if (!sync.hierarchical()) return "not hierarchical";
        if (sync.host_leader() != (rank != 2)) return "wrong leader";
        s.forward_backward(s.order().rank_slice(0, rank, 3), 0, rank, &sync);
        auto t = sync.finish();
        if (!t) return t.message();
        return compare_gradients(s, want);
      }));
}

// Hierarchical with the bf16 wire: each host's fp32 sum crosses as bf16
// once and every rank ends with the fp32 sum of those, bit for bit (2
// hosts: all-gather); with 3 hosts (reduce-scatter) that sum rounded to
// bf16 once more. Steps keep the ranks' parameters equal.
TEST(GradSync, HierarchicalBf16WireKeepsRanksEqual) {
  for (const auto& keys : std::vector<std::vector<std::string>>{{"a", "a", "b", "b"}, {"a", "a", "b", "c", "c"}}) {
    const int world = static_cast<int>(keys.size());
    SCOPED_TRACE("world " + std::to_string(world));
    auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
    auto states = make_states(cfg, world);
    const int64_t floats = gradient_floats(*states[0]);
    std::vector<std::vector<torch::Tensor>> own(world);
    {
      auto ref = make_states(cfg, 1);
      for (int r = 0; r < world; ++r) {
        ref[0]->zero_grad();
        ref[0]->forward_backward(ref[0]->order().rank_slice(0, r, world), 0, r);
        for (auto& g : ref[0]->gradients()) own[r].push_back(g.clone());
      }
    }
    std::vector<std::vector<torch::Tensor>> got(world);
    expect_no_errors(run_on_hosts(keys, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& p) -> std::string {
      auto& s = *states[rank];
      auto o = options_for(p, 4 * 1024);
      o.exchange.codec = wire_codec::bf16;
      grad_sync sync(params_of(s), pg, o);
      if (!sync.hierarchical()) return "not hierarchical";
      s.forward_backward(s.order().rank_slice(0, rank, world), 0, rank, &sync);
      auto t = sync.finish();
      if (!t) return t.message();
      for (auto& g : s.gradients()) got[rank].push_back(g.clone());
      return "";
    }));
    ASSERT_EQ(got[0].size(), own[0].size());
    const auto hosts = group_by_host(keys);
    for (size_t i = 0; i < own[0].size(); ++i) {
      torch::Tensor want;
      for (const auto& h : hosts) {
        auto host_sum = own[h[0]][i].clone();
        for (size_t l = 1; l < h.size(); ++l) host_sum += own[h[l]][i];
        auto part = host_sum.to(torch::kBFloat16).to(torch::kFloat);
        want = want.defined() ? want + part : part;
      }
      if (hosts.size() >= 3) want = want.to(torch::kBFloat16).to(torch::kFloat);
      EXPECT_TRUE(torch::equal(got[0][i], want)) << "gradient " << i << " is not the sum of the hosts' bf16-rounded sums";
      for (int r = 1; r < world; ++r) EXPECT_TRUE(torch::equal(got[0][i], got[r][i])) << "rank " << r << " gradient " << i;
    }
  }
  const int64_t floats = gradient_floats(*make_states(tiny_vit_config(), 1)[0]);
  auto again = make_states(tiny_vit_config(), 4);
  std::vector<std::string> digests(4);
  expect_no_errors(
      run_on_hosts({"a", "a", "b", "b"}, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& p) -> std::string {
        auto& s = *again[rank];
        auto o = options_for(p, 16 * 1024);
        o.exchange.codec = wire_codec::bf16;
        grad_sync sync(params_of(s), pg, o);
        for (int i = 0; i < 5; ++i)
          if (auto r = s.train_step(step_context::every_step(rank, 4, sync)); !r) return r.message();
        digests[rank] = s.params_digest();
        return "";
      }));
  for (int r = 1; r < 4; ++r) EXPECT_EQ(digests[r], digests[0]) << "rank " << r;
}

// A host's leader whose exchange across hosts fails (here: the other host's
// leader never sends) fails its step, and its host's other rank fails at
// once with it instead of waiting out the timeout.
TEST(GradSync, AFailedLeaderFailsItsHostsRanksAtOnce) {
  std::vector<std::string> outcome(4);
  std::vector<double> took(4);
  std::atomic<int> finished{0};
  run_on_hosts({"a", "a", "b", "b"}, 64, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& plan) -> std::string {
    auto q = torch::zeros({64}, torch::requires_grad());
    auto o = options_for(plan, 1024);
    o.timeout = std::chrono::milliseconds(rank == 0 ? 1500 : 60000);
    grad_sync sync({q}, pg, o);
    if (rank >= 2) {
      // Host b never takes part, but keeps its groups open until host a is done.
      while (finished.load() < 2) std::this_thread::sleep_for(std::chrono::milliseconds(5));
      return "";
    }
    (q * (rank + 1)).sum().backward();
    const auto t0 = std::chrono::steady_clock::now();
    auto r = sync.finish();
    took[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    outcome[rank] = r ? "ok" : r.message();
    ++finished;
    return "";
  });
  EXPECT_NE(outcome[0].find("timed out"), std::string::npos) << outcome[0];
  EXPECT_NE(outcome[1].find("rank 0 of this host's group"), std::string::npos) << outcome[1];
  EXPECT_LT(took[1], 30.0) << "rank 1 waited out its own timeout";
}

TEST(ShmGroup, EveryRankGetsTheSameAnswer) {
  const int world = 3;
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> why(world), errors(world);
  std::vector<int> got(world, -1);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto g = shm_group::join(*store, r, world, r == 2 ? 100 : 64, &why[r]);
      if (!g)
        errors[r] = g.message();
      else
        got[r] = g.value() ? 1 : 0;
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(errors[r].empty()) << errors[r];
    EXPECT_EQ(got[r], 0) << "rank " << r;
    EXPECT_NE(why[r].find("rank 2"), std::string::npos) << why[r];
  }
  // The same ranks with matching shapes do share one.
  auto store2 = c10::make_intrusive<c10d::HashStore>();
  threads.clear();
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      auto g = shm_group::join(*store2, r, world, 64, &why[r]);
      got[r] = g && g.value() ? 1 : 0;
      if (got[r]) {
        auto region = g.value()->reserve(64);
        if (!region) {
          got[r] = 3;
          return;
        }
        g.value()->at(r, region.value())[63] = static_cast<float>(r);
        g.value()->publish(region.value());
        auto st = g.value()->wait_all(1, std::chrono::steady_clock::now() + std::chrono::seconds(10), {}, std::chrono::microseconds(0), "test");
        if (!st || g.value()->at((r + 1) % world, region.value())[63] != static_cast<float>((r + 1) % world)) got[r] = 2;
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(got[r], 1) << "rank " << r;
}

// How a waiting rank tells that a peer on its host died: a live process, a
// zombie (exited, parent never reaped it: what a killed rank of a killed
// node agent becomes in a container whose init does not reap) and a reaped one.
// The ring: regions follow each other, wrap to the start when the next one
// does not fit, and each names the last region it covers (what every rank
// must have consumed before it is written); waiting for it ends at the
// deadline with one line, and consuming frees it.
TEST(ShmGroup, RingRegionsWaitForWhatTheyCover) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::string why;
  auto joined = shm_group::join(*store, 0, 1, 64, &why);
  ASSERT_TRUE(joined && joined.value()) << why;
  auto& g = *joined.value();
  std::vector<shm_group::region> r;
  for (int i = 0; i < 4; ++i) r.push_back(g.reserve(10).value());  // rounded to 16
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(r[i].offset, 16 * i);
    EXPECT_EQ(r[i].count, static_cast<uint64_t>(i + 1));
    EXPECT_EQ(r[i].free_after, 0u);
    EXPECT_EQ(g.at(0, r[i]), g.at(0, r[0]) + 16 * i);
  }
  auto e = g.reserve(16).value();  // wraps onto the first
  EXPECT_EQ(e.offset, 0);
  EXPECT_EQ(e.free_after, 1u);
  auto f = g.reserve(40).value();  // covers the second, third and fourth
  EXPECT_EQ(f.offset, 16);
  EXPECT_EQ(f.free_after, 4u);
  auto h = g.reserve(16).value();  // 56 + 16 > 64: wraps, covering e
  EXPECT_EQ(h.offset, 0);
  EXPECT_EQ(h.free_after, e.count);
  // f is partly covered by i and left the list, but its rest is still read
  // until it is consumed: j, which covers only that rest, waits for it too.
  auto i = g.reserve(16).value();
  EXPECT_EQ(i.offset, 16);
  EXPECT_EQ(i.free_after, f.count);
  auto j = g.reserve(16).value();
  EXPECT_EQ(j.offset, 32);
  EXPECT_EQ(j.free_after, f.count);
  auto big = g.reserve(65);
  ASSERT_FALSE(big);
  EXPECT_NE(big.message().find("does not fit"), std::string::npos) << big.message();

  EXPECT_FALSE(g.is_free(h));
  EXPECT_FALSE(g.is_free(j));
  int progress_calls = 0;
  auto st = g.wait_free(h, std::chrono::steady_clock::now() + std::chrono::milliseconds(20), {}, std::chrono::microseconds(0), "ring test",
                        [&] {
                          ++progress_calls;
                          return status{};
                        });
  ASSERT_FALSE(st);
  EXPECT_NE(st.message().find("ring test timed out"), std::string::npos) << st.message();
  EXPECT_GT(progress_calls, 0);
  // Progress that consumes frees it.
  st = g.wait_free(h, std::chrono::steady_clock::now() + std::chrono::seconds(10), {}, std::chrono::microseconds(0), "ring test", [&] {
    g.consume(e.count);
    return status{};
  });
  EXPECT_TRUE(st) << st.message();
  EXPECT_TRUE(g.is_free(h));
  EXPECT_EQ(g.consumed(0), e.count);
}

// Gradient buckets through a ring of two of the largest buckets, far less
// than a step: the same sums as one process, bit-identical on every rank,
// over several steps.
TEST(GradSync, SharedMemoryRingSmallerThanAStepMatchesSingleProcess) {
  expect_shm_matches_single_process(
      1,
      [](training_state& s) {
        int64_t largest = 0;
        for (auto& p : params_of(s)) largest = std::max<int64_t>(largest, p.numel());
        const int64_t slot = 2 * (256 + largest + step_control::words + 16);
        EXPECT_LT(slot, gradient_floats(s) + step_control::words) << "the ring should hold less than a step";
        return slot;
      },
      4);
}

TEST(ShmGroup, ProcessExitedSeesZombiesAndReapedProcesses) {
  EXPECT_FALSE(process_exited(static_cast<int>(::getpid())));
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  // Wait for the exit without reaping (WNOWAIT leaves the zombie in place).
  siginfo_t info{};
  ASSERT_EQ(::waitid(P_PID, static_cast<id_t>(child), &info, WEXITED | WNOWAIT), 0);
  EXPECT_TRUE(process_exited(child)) << "zombie " << child << " looked alive";
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  EXPECT_TRUE(process_exited(child)) << "reaped " << child << " looked alive";
}

// A peer that never publishes: the wait ends at the deadline, or at once
// when a newer generation abandons it, whether polling or sleeping.
TEST(GradSync, SharedMemoryWaitEndsOnTimeoutOrAbandon) {
  for (bool abandon : {false, true})
    for (int spin_us : {0, 10000000}) {
      std::atomic<bool> done{false};
      expect_no_errors(run_ranks_shm(2, 8, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) -> std::string {
        if (rank == 1) {
          while (!done.load()) std::this_thread::yield();
          return "";
        }
        auto p = torch::ones({8}, torch::requires_grad());
        grad_sync_options o;
        o.exchange.transport = exchange_transport::shared_memory;
        o.shm = shm;
        o.spin_wait = std::chrono::microseconds(spin_us);
        o.timeout = std::chrono::milliseconds(abandon ? 30000 : 150);
        const auto t0 = std::chrono::steady_clock::now();
        if (abandon) o.abandon = [&] { return std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(100); };
        grad_sync sync({p}, pg, o);
        sync.arm();
        (p * 2).sum().backward();
        auto t = sync.finish();
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        done = true;
        if (t) return "finish() succeeded without the peer";
        if (t.message().find(abandon ? "abandoned" : "timed out") == std::string::npos) return "unexpected: " + t.message();
        if (waited > 2.0) return "finish() waited " + std::to_string(waited) + " s";
        if (sync.finish()) return "a second finish() succeeded";
        return "";
      }));
    }
}

}  // namespace
}  // namespace dtactor
