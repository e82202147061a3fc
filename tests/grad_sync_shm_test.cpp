// The gradient reducer through shared memory and hierarchically (hosts
// of ranks), and the shared-memory group itself.
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
#include "grad_sync_util.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using namespace grad_sync_testing;

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
