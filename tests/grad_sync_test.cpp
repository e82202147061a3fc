// The gradient reducer over a process group: sums, buckets, the step's
// control words, the bf16 wire, unused parameters, timeouts. Through
// shared memory and hierarchically: grad_sync_shm_test.cpp.
#include "comm/grad_sync.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <fstream>
#include <functional>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "model/flat_adamw.hpp"
#include "model/shard_plan.hpp"
#include "model/trainer.hpp"
#include "rank/zero.hpp"
#include "rank_threads.hpp"
#include "comm/communicator.hpp"
#include "base/process.hpp"
#include "comm/shm_group.hpp"
#include "grad_sync_util.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using namespace grad_sync_testing;
using testing::reset_peak;
using testing::status_kb;

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

// The control word rides with the last bucket: every rank reads the same
// sums of what each set, over several steps, and the gradients are unchanged.
TEST(GradSync, ControlWordIsSummedWithTheLastBucket) {
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

// A control source is read when the last bucket is launched, at the end of
// backward: a plan that arrives after the step began (after set_control),
// even while backward runs, is in this step's sums, so every rank switches
// one step earlier. When it is read, the gradient of the module's first
// parameter (backward's last) is in hand. A world of one reads it at
// finish().
TEST(GradSync, ControlSourceIsReadWhenTheLastBucketIsLaunched) {
  const int world = 2;
  auto cfg = tiny_vit_config({"cluster.bucket_kb=4"});
  auto states = make_states(cfg, world);
  expect_no_errors(run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    const auto params = params_of(s);
    grad_sync sync(params, pg, control_options());
    if (sync.bucket_layout().size() < 3) return "want several buckets, got " + std::to_string(sync.bucket_layout().size());
    bool plan_arrived = false, finishing = false;
    int read_in_backward = 0, read_in_finish = 0, read_early = 0;
    sync.set_control_source([&] {
      ++(finishing ? read_in_finish : read_in_backward);
      const auto& g = params.front().grad();
      if (!g.defined() || g.abs().sum().item<double>() == 0) ++read_early;
      return ctl(plan_arrived ? 1.f : 0.f, 0.f);
    });
    for (int step = 0; step < 2; ++step) {
      sync.set_control(ctl(0.f, 0.f));  // the step starts with no newer plan
      plan_arrived = step == 1;         // one arrives during step 1
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
    if (read_early != 0) return "the source was read " + std::to_string(read_early) + " times before the first parameter's gradient was in hand";
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

// A zero=2 reducer keeps no bucket buffer between steps, and making one
// must not touch 4 bytes a parameter on the way (its buffers are shaped
// and dropped): the peak it adds at a generation's start is far below the
// gradients' size (the buffers were once zero-filled there: a whole
// model's gradient on top of the model, at every generation's start).
TEST(GradSync, AZeroTwoReducerTouchesNoBucketBufferWhenMade) {
  constexpr int world = 2;
  std::vector<std::vector<torch::Tensor>> params(world);  // 48 MB of gradients a rank
  std::vector<std::unique_ptr<flat_adamw>> opts;
  for (int r = 0; r < world; ++r) {
    for (int i = 0; i < 48; ++i) params[r].push_back(torch::randn({256, 1024}).requires_grad_());
    opts.push_back(std::make_unique<flat_adamw>(params[r], flat_adamw_options{}));
  }
  const auto plan = make_shard_plan(opts[0]->total_elements(), {"a", "b"}, 1);
  for (int r = 0; r < world; ++r) opts[static_cast<size_t>(r)]->shard(plan.ranges_of(r));
  ASSERT_TRUE(reset_peak());
  const int64_t before = status_kb("VmRSS:");
  ASSERT_GT(before, 0);
  const auto errors = testing::run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    grad_sync_options o;
    o.bucket_bytes = 2 << 20;
    o.zero2 = zero2_of(*opts[static_cast<size_t>(rank)], plan);
    grad_sync sync(params[static_cast<size_t>(rank)], pg, o);
    if (sync.bucket_count() < 2) return "one bucket: the test needs many";
    return sync.buffer_bytes() == 0 ? "" : "buffers kept between steps";
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  const int64_t added_kb = status_kb("VmHWM:") - before;
  // Zero-filled, the buffers add 96 MB here.
  std::printf("the reducers' construction added %lld kB at its peak\n", static_cast<long long>(added_kb));
  EXPECT_LT(added_kb, 24 * 1024) << "the reducers' construction added " << added_kb << " kB at its peak";
}

}  // namespace
}  // namespace dtactor
