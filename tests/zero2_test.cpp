// train.zero = 2 and 3: gradients reduce-scattered as well, over Gloo,
// shared memory or per host; bf16 on the wire and in the masters; a step
// interrupted on one rank. Ranks are threads.
#include "comm/peer_moves.hpp"
#include "rank/zero.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <torch/torch.h>

#include <algorithm>
#include <set>
#include <thread>

#include "model/flat_adamw.hpp"
#include "model/shard_plan.hpp"
#include "model/trainer.hpp"
#include "rank/state_io.hpp"
#include "rank/zero3.hpp"
#include "rank/zero_sync.hpp"
#include "interrupted_sync.hpp"
#include "rank_threads.hpp"
#include "comm/grad_sync.hpp"
#include "comm/step_control.hpp"
#include "test_util.hpp"
#include "zero_test_util.hpp"

namespace dtactor {
namespace {

using namespace zero_test;
using testing::interrupted_sync;

// How a zero-2 comparison runs: over Gloo or shared memory, fp32 or bf16 on
// the wire, with the bound on buffers in flight.
struct run_how {
  bool shm = false, bf16 = false;
  int64_t inflight_bytes = 64 << 20;
  // Shared memory's ring as small as it may be (room for two of the
  // largest buckets), far less than a step: regions wait to be read and
  // the all-gather goes in many rounds.
  bool small_ring = false;
  // Non-empty: ranks on these hosts (equal keys share one), each host's
  // ranks over shared memory and the hosts' leaders over Gloo (hierarchical).
  std::vector<std::string> hosts;
  // With hosts: the parameter all-gather through each host's segment, as
  // the rank worker does when every host holds every shard (an error when
  // the plan does not let it); `host_gathers` counts those that ran.
  bool host_gather = false;
  std::atomic<int>* host_gathers = nullptr;
};

// A parameter sync that counts the gathers of the one it wraps.
class counted_gathers final : public param_sync {
 public:
  counted_gathers(std::unique_ptr<param_sync> inner, std::atomic<int>* n) : inner_(std::move(inner)), n_(n) {}
  bool sharded_norm() const override { return inner_->sharded_norm(); }
  result<double> global_norm() override { return inner_->global_norm(); }
  status gather() override {
    if (n_) ++*n_;
    return inner_->gather();
  }
  std::string describe() const override { return inner_->describe(); }

 private:
  std::unique_ptr<param_sync> inner_;
  std::atomic<int>* n_;
};

// `steps` data-parallel steps; with a plan and zero2, the gradients go
// only to their holders and the norm is the shards' (rank/zero). Returns
// the errors; `norms` gets rank 0's gradient norms.
std::vector<std::string> train_how(std::vector<std::unique_ptr<training_state>>& states, int world, int steps, const shard_plan* plan, bool zero2,
                                   const run_how& h, std::vector<double>* norms = nullptr) {
  int64_t floats = step_control::words, largest = 0;
  for (auto& p : states[0]->the_task().module()->parameters()) {
    floats += p.numel();
    largest = std::max<int64_t>(largest, p.numel());
  }
  // small_ring: buckets of 1 KB, so that a step is many of them.
  const int64_t bucket_bytes = h.small_ring ? 1024 : buckets().bucket_bytes;
  const int64_t slot = h.small_ring ? 2 * (bucket_bytes / 4 + largest + step_control::words + 16) : floats;
  auto body = [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm, const exchange_plan* xp) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    grad_sync_options o = buckets();
    o.bucket_bytes = bucket_bytes;
    o.carry_control = true;
    o.exchange.transport = exchange_transport::shared_memory;
    o.shm = shm;
    if (xp) {
      o.exchange.transport = transport_for(o.exchange, *xp);
      o.shm = xp->shm;
      o.hosts = xp->hosts;
    }
    if (h.bf16) o.exchange.codec = wire_codec::bf16;
    if (plan && zero2) {
      auto z = std::const_pointer_cast<zero2_grads>(zero2_of(s.optimizer(), *plan));
      z->inflight_bytes = h.inflight_bytes;
      o.zero2 = z;
    }
    grad_sync sync(s.the_task().module()->parameters(), pg, o);
    if (xp && !sync.hierarchical()) return "not hierarchical";
    if (h.small_ring && shm && shm->capacity() >= floats) return "the ring holds " + std::to_string(shm->capacity()) + " floats of a step's " + std::to_string(floats);
    if (!xp && h.shm != sync.uses_shm()) return "shared memory " + std::string(sync.uses_shm() ? "used" : "not used");
    const zero_sync_settings zs = zero_sync(pg, plan != nullptr);
    std::unique_ptr<param_sync> ps;
    if (plan) ps = zero_sync_over_group(s.optimizer(), *plan, zs);
    // One host's world (as the rank worker does): the all-gather and the
    // norm's sum through the gradients' segment, between their steps.
    if (plan && shm && !xp) {
      if (!shm_fits(*shm, s.optimizer(), *plan)) return "the parameters do not fit the segment";
      ps = zero_sync_over_segment(shm, s.optimizer(), *plan, zs);
    }
    if (plan && xp && h.host_gather) {
      if (!xp->hierarchical || !hosts_cover_every_shard(*plan, xp->host_groups)) return "the hosts do not each hold every shard";
      ps = std::make_unique<counted_gathers>(zero_sync_within_hosts(xp->shm, xp->host_members, s.optimizer(), *plan, zs), h.host_gathers);
    }
    // bf16's masters sharded (as the rank worker's gate_units): the copies
    // gathered whole after each update, through the segment or the group.
    std::shared_ptr<unit_gatherer> gate;
    if (plan && masters_sharded(s.settings().train)) {
      std::vector<int> all(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) all[static_cast<size_t>(r)] = r;
      auto layout = unit_layout_of(s.optimizer(), s.the_task().param_units());
      if (!layout) return layout.message();
      gate = std::make_shared<unit_gatherer>(pg, s.optimizer(), *plan, layout_for(std::move(layout.value()), unit_policy::copies_resident),
                                             zs.timeout, std::function<bool()>{}, shm && !xp ? gather_route::through(shm, all, false) : gather_route::over_group(),
                                             std::chrono::microseconds(0), unit_policy::copies_resident);
      ps = zero3_sync(std::move(ps), gate, "gloo");
      gate->reshard();
      if (auto st = gate->after_update(); !st) return st.message();
    }
    sync.set_parameter_sync(std::move(ps));
    for (int i = 0; i < steps; ++i) {
      auto r = s.train_step(step_context::every_step(rank, world, sync));
      if (!r) return r.message();
      if (norms && rank == 0) norms->push_back(r->grad_norm);
      if (zero2)
        for (auto& p : s.the_task().module()->parameters())
          if (p.grad().defined()) return "a full gradient is left after the step";
    }
    return "";
  };
  if (!h.hosts.empty())
    return testing::run_on_hosts(h.hosts, floats, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, const exchange_plan& xp) {
      return body(rank, pg, nullptr, &xp);
    });
  if (h.shm)
    return testing::run_ranks_shm(world, slot, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<shm_group> shm) {
      return body(rank, pg, shm, nullptr);
    });
  return run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) { return body(rank, pg, nullptr, nullptr); });
}

// Two jobs from the same start, zero=0 and zero=2 (R holders a shard); the
// final parameters of every zero=2 rank against the zero=0 ones.
struct zero2_pair {
  std::vector<std::unique_ptr<training_state>> plain, sharded;
  shard_plan plan;
  std::vector<double> plain_norms, sharded_norms;
};
// `level`: the sharded run's train.zero; `nodes`: the plan's node of each
// rank (empty: a node per rank).
zero2_pair run_pair(const std::vector<std::string>& extra, int world, int replicas, int steps, const run_how& h, int level = 2,
                    std::vector<std::string> nodes = {}) {
  std::vector<std::string> o0 = extra, o2 = extra;
  o2.push_back("train.zero=" + std::to_string(level));
  zero2_pair p;
  p.plain = make_states(tiny_vit_config(o0), world);
  p.sharded = make_states(tiny_vit_config(o2), world);
  p.plan = make_shard_plan(p.sharded[0]->optimizer().total_elements(), nodes.empty() ? nodes_of(world) : nodes, replicas);
  for (int r = 0; r < world; ++r) p.sharded[static_cast<size_t>(r)]->shard_optimizer(p.plan.ranges_of(r));
  run_how plain = h;
  plain.host_gather = false;
  expect_no_errors(train_how(p.plain, world, steps, nullptr, false, plain, &p.plain_norms));
  expect_no_errors(train_how(p.sharded, world, steps, &p.plan, level >= 2, h, &p.sharded_norms));
  return p;
}

// Over shared memory each rank sums only its pieces, in the same order as
// the whole bucket's sum: bit for bit zero=0's parameters, also when the
// bound on buffers in flight makes backward wait for every bucket at once.
// Each rank then holds only its shards' gradients.
TEST(Zero2, SharedMemoryReduceScatterEqualsZeroZeroBitForBit) {
  for (int64_t inflight : {int64_t{64} << 20, int64_t{1}}) {
    SCOPED_TRACE("inflight_bytes " + std::to_string(inflight));
    run_how h;
    h.shm = true;
    h.inflight_bytes = inflight;
    auto p = run_pair({"train.grad_clip=0"}, 3, 2, 4, h);
    const std::string want = p.plain[0]->params_digest();
    for (int r = 0; r < 3; ++r) {
      auto& s = *p.sharded[static_cast<size_t>(r)];
      EXPECT_EQ(s.params_digest(), want) << "rank " << r;
      EXPECT_EQ(s.optimizer().grad_bytes(), 4 * p.plan.held_elements(r)) << "rank " << r << " holds its shards' gradients only";
      EXPECT_LT(s.optimizer().grad_bytes(), p.plain[0]->optimizer().grad_bytes());
    }
  }
}

// The segment's ring far smaller than a step (two of the largest buckets):
// backward packs a bucket into its flat tensor when its region is still
// being read and waits for it, ranks sum earlier buckets while they wait,
// and the parameter all-gather goes in rounds of half the ring. The sums
// keep their order: zero=0 is bit for bit zero=0 with a whole-step ring,
// and zero=2 bit for bit zero=0, also when every bucket waits at once.
TEST(Zero2, SharedMemoryRingSmallerThanAStepChangesNoBit) {
  run_how whole;
  whole.shm = true;
  auto w = run_pair({"train.grad_clip=0"}, 3, 2, 4, whole);
  const std::string want = w.plain[0]->params_digest();
  for (int64_t inflight : {int64_t{64} << 20, int64_t{1}}) {
    SCOPED_TRACE("inflight_bytes " + std::to_string(inflight));
    run_how h;
    h.shm = true;
    h.small_ring = true;
    h.inflight_bytes = inflight;
    auto p = run_pair({"train.grad_clip=0"}, 3, 2, 4, h);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(p.plain[static_cast<size_t>(r)]->params_digest(), want) << "zero=0, rank " << r;
      EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), want) << "zero=2, rank " << r;
    }
  }
  // Clipping on: the norm's values in rounds through the ring as well (a
  // round carries at most a quarter of the ring's floats in doubles).
  run_how h;
  h.shm = true;
  h.small_ring = true;
  auto p = run_pair({}, 4, 2, 3, h);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), p.plain[0]->params_digest()) << "rank " << r;
  EXPECT_EQ(p.sharded_norms, p.plain_norms);
}

// Clipping on: 1.0 (the default ViT's) and 0.01 (below every step's norm,
// so every step clips). The norm is model/grad_norm's at every level: the
// same ranges summed in double and added in index order whether a rank
// holds the whole gradient or its shards, so over shared memory zero=1 and
// zero=2 end bit for bit where zero=0 ends, with the same norms, at worlds
// 2 and 3 (whose shards cut the index space elsewhere).
TEST(Zero2, ClippingOnSharedMemoryEveryLevelEqualsZeroZeroBitForBit) {
  for (const std::string clip : {"1.0", "0.01"})
    for (int world : {2, 3})
      for (int level : {1, 2}) {
        SCOPED_TRACE("grad_clip " + clip + ", world " + std::to_string(world) + ", zero " + std::to_string(level));
        run_how h;
        h.shm = true;
        auto p = run_pair({"train.grad_clip=" + clip}, world, 2, 5, h, level);
        const std::string want = p.plain[0]->params_digest();
        for (int r = 0; r < world; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), want) << "rank " << r;
        ASSERT_EQ(p.plain_norms.size(), 5u);
        ASSERT_EQ(p.sharded_norms.size(), 5u);
        for (size_t i = 0; i < p.plain_norms.size(); ++i) {
          EXPECT_EQ(p.sharded_norms[i], p.plain_norms[i]) << "step " << i;
          if (clip == "0.01") {
            EXPECT_GT(p.plain_norms[i], 0.01) << "step " << i << " did not clip";
          }
        }
      }
}

// One host, clipping on (as by default): the parameters all-gathered and
// the norm's per-range values exchanged through the gradients' segment.
// Every rank ends bit for bit equal to the others and to zero=0, with
// zero=0's norms.
TEST(Zero2, SharedMemoryGatherAndNormKeepEveryRankEqual) {
  run_how h;
  h.shm = true;
  auto p = run_pair({}, 4, 2, 4, h);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), p.plain[0]->params_digest()) << "rank " << r;
  ASSERT_EQ(p.plain_norms.size(), 4u);
  for (double n : p.plain_norms) EXPECT_GT(n, 0);
  EXPECT_EQ(p.sharded_norms, p.plain_norms);
}

// Hierarchical (2 hosts x 2 ranks): each host's leader sums the whole of
// its host's buckets (not only the pieces it keeps) before they cross
// hosts, so every rank receives the world's sum of its pieces: bit for bit
// zero=0's parameters over the same exchange. (The leader once summed only
// its own pieces: the other ranks' shards got partial sums, and the loss
// became NaN at the second step.)
TEST(Zero2, HierarchicalExchangeEqualsZeroZeroBitForBit) {
  run_how h;
  h.hosts = {"h1", "h1", "h2", "h2"};
  auto p = run_pair({"train.grad_clip=0"}, 4, 2, 3, h);
  const std::string want = p.plain[0]->params_digest();
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), want) << "rank " << r;
}

// The same 2 hosts x 2 ranks with the nodes as the hosts (the plan puts each
// shard's replica on the other host): each host's two ranks hold every
// shard between them, so the parameter all-gather is a round of each
// host's segment, not Gloo across the four: still bit for bit zero=0's, at
// zero=1 and zero=2.
TEST(Zero2, HierarchicalWithEveryShardOnEachHostGathersWithinTheHostsBitForBit) {
  for (int level : {1, 2}) {
    SCOPED_TRACE("train.zero=" + std::to_string(level));
    std::atomic<int> gathers{0};
    run_how h;
    h.hosts = {"h1", "h1", "h2", "h2"};
    h.host_gather = true;
    h.host_gathers = &gathers;
    auto p = run_pair({"train.grad_clip=0"}, 4, 2, 3, h, level, h.hosts);
    EXPECT_EQ(gathers.load(), 4 * 3);
    const std::string want = p.plain[0]->params_digest();
    for (int r = 0; r < 4; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), want) << "rank " << r;
  }
}

// Which plans let each host gather alone: 2 hosts with two holders a shard
// do; one holder a shard, or 3 hosts with two, do not (a host lacks the
// shards of the host that is neither a primary's nor its replica's).
TEST(Zero, HostsCoverEveryShardOnlyWhenEachHostHoldsThemAll) {
  const std::vector<std::string> two = {"a", "a", "b", "b"}, three = {"a", "a", "b", "b", "c", "c"};
  const std::vector<std::vector<int>> hosts2 = {{0, 1}, {2, 3}}, hosts3 = {{0, 1}, {2, 3}, {4, 5}};
  EXPECT_TRUE(hosts_cover_every_shard(make_shard_plan(1000, two, 2), hosts2));
  EXPECT_FALSE(hosts_cover_every_shard(make_shard_plan(1000, two, 1), hosts2));
  EXPECT_FALSE(hosts_cover_every_shard(make_shard_plan(1000, three, 2), hosts3));
  // Three holders on 3 hosts (the nodes): one on each, so each host holds all.
  EXPECT_TRUE(hosts_cover_every_shard(make_shard_plan(1000, three, 3), hosts3));
  // A node per rank puts replicas by rank order, not by host.
  EXPECT_FALSE(hosts_cover_every_shard(make_shard_plan(1000, nodes_of(4), 2), hosts2));
  // A host of one rank covers them when it holds them all: here it is the
  // replica of both of the other host's shards.
  const auto lone = make_shard_plan(1000, {"a", "a", "b"}, 2);
  ASSERT_EQ(lone.held_by(2), (std::vector<int>{0, 1, 2}));
  EXPECT_TRUE(hosts_cover_every_shard(lone, {{0, 1}, {2}}));
  EXPECT_FALSE(hosts_cover_every_shard(make_shard_plan(1000, {"a", "a", "b"}, 1), {{0, 1}, {2}}));
  EXPECT_FALSE(hosts_cover_every_shard(make_shard_plan(1000, two, 2), {}));
}

// The host's all-gather in many rounds of a small segment: ranks 0 and 1
// of 2 hosts x 2 ranks (host a), each with only its own shards right
// (primaries and replicas, streams of two shards each) and garbage
// elsewhere, end with every parameter right.
TEST(Zero, TheHostAllGatherInRoundsOfASmallSegmentBringsEveryShardTheHostLacks) {
  auto cfg = tiny_vit_config({"train.zero=1"});
  auto states = make_states(cfg, 2);
  const int64_t total = states[0]->optimizer().total_elements();
  const auto plan = make_shard_plan(total, {"a", "a", "b", "b"}, 2);
  ASSERT_EQ(plan.held_by(0), (std::vector<int>{0, 2}));
  ASSERT_EQ(plan.held_by(1), (std::vector<int>{1, 3}));
  torch::manual_seed(7);
  const auto truth = torch::randn({total});
  auto set = [](flat_adamw& opt, int64_t a, int64_t b, const torch::Tensor& v) {
    torch::NoGradGuard ng;
    int64_t at = 0;
    for (auto& t : opt.param_views(a, b)) {
      t.copy_(v.narrow(0, at, t.numel()).view(t.sizes()));
      at += t.numel();
    }
  };
  for (int r = 0; r < 2; ++r) {
    auto& opt = states[static_cast<size_t>(r)]->optimizer();
    set(opt, 0, total, torch::full({total}, -1000.f));
    for (int sh : plan.held_by(r)) {
      const auto& x = plan.shards[static_cast<size_t>(sh)];
      set(opt, x.begin, x.end, truth.narrow(0, x.begin, x.end - x.begin));
    }
  }
  expect_no_errors(testing::run_ranks_shm(2, 256, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup>, std::shared_ptr<shm_group> shm) -> std::string {
    if (shm->capacity() >= total / 4) return "the segment holds a whole shard: one round";
    for (int i = 0; i < 2; ++i)  // twice: the ring's regions are free again after a gather
      if (auto st = gather_params_host(*shm, {0, 1}, states[static_cast<size_t>(rank)]->optimizer(), plan, std::chrono::milliseconds(20000), {},
                                       std::chrono::microseconds(50));
          !st)
        return st.message();
    return "";
  }));
  for (int r = 0; r < 2; ++r) {
    auto got = torch::cat([&] {
      std::vector<torch::Tensor> v;
      for (auto& t : states[static_cast<size_t>(r)]->optimizer().param_views(0, total)) v.push_back(t.detach().reshape({-1}));
      return v;
    }());
    EXPECT_TRUE(torch::equal(got, truth)) << "rank " << r;
  }
}

// Micro-batches accumulate in autograd's gradients until the step's last
// backward hands them to the buckets: still bit for bit.
TEST(Zero2, GradientAccumulationEqualsZeroZeroBitForBit) {
  run_how h;
  h.shm = true;
  auto p = run_pair({"train.grad_clip=0", "train.micro_batch_size=3"}, 2, 1, 3, h);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), p.plain[0]->params_digest()) << "rank " << r;
}

// The bf16 wire: the zero scatter sends bf16 pieces and sums them as the
// bf16 exchanges of zero=0 do (all-gather at 2 ranks, reduce-scatter from
// 3): bit for bit, over Gloo.
TEST(Zero2, Bf16WireOverGlooEqualsZeroZeroBitForBit) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_how h;
    h.bf16 = true;
    h.inflight_bytes = 1;
    auto p = run_pair({"train.grad_clip=0"}, world, 2, 3, h);
    for (int r = 0; r < world; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), p.plain[0]->params_digest()) << "rank " << r;
  }
}

// The masters of [0, total) one after another.
torch::Tensor flat_masters(training_state& s, int64_t begin, int64_t end) {
  return torch::cat(s.optimizer().param_views(begin, end));
}

// A sharded run's whole masters, each shard's from its primary.
torch::Tensor whole_masters(const zero2_pair& p) {
  std::vector<torch::Tensor> parts;
  for (const auto& sh : p.plan.shards)
    if (sh.begin < sh.end) parts.push_back(flat_masters(*p.sharded[static_cast<size_t>(sh.holders.front())], sh.begin, sh.end));
  return torch::cat(parts);
}

// The module's bf16 parameters (the compute copy), in index order.
torch::Tensor flat_copies(training_state& s) {
  return torch::cat(s.optimizer().compute_views(0, s.optimizer().total_elements()));
}

// train.precision = bf16 (bf16 parameters and gradients, fp32 masters): the
// gradients are summed in fp32 buckets, over Gloo and through shared
// memory. The masters are sharded state from level 1 on: a rank keeps its
// shards' (the rest of the buffer is never written: zeros), and its bf16
// copies, whole, are gathered from the primaries after each update. Level 1
// takes the sums as level 0 does (rounded to the bf16 gradients, read as
// fp32 by the optimizer) and steps the same masters: bit for bit. Level 2
// delivers each shard's fp32 sum without that rounding: every rank agrees,
// and the masters stay within a few bf16 steps of level 0's.
TEST(Zero2, Bf16PrecisionShardsTheMastersAtLevelsOneAndTwo) {
  for (bool shm : {false, true}) {
    SCOPED_TRACE(shm ? "shared memory" : "Gloo");
    run_how h;
    h.shm = shm;
    for (int level : {1, 2}) {
      SCOPED_TRACE("level " + std::to_string(level));
      auto p = run_pair({"train.precision=bf16", "model.dim=64", "model.layers=3", "model.heads=4"}, 2, 1, 3, h, level);
      const int64_t total = p.plan.total;
      const torch::Tensor plain = flat_masters(*p.plain[0], 0, total), sharded = whole_masters(p);
      if (level == 1) {
        EXPECT_TRUE(torch::equal(sharded, plain));
      }
      // Adam moves an element by about lr (0.003) a step whatever its gradient.
      EXPECT_LT((sharded - plain).abs().max().item<double>(), 3 * 3 * 0.003);
      for (int r = 0; r < 2; ++r) {
        auto& s = *p.sharded[static_cast<size_t>(r)];
        ASSERT_EQ(s.the_task().module()->parameters()[0].scalar_type(), torch::kBFloat16);
        EXPECT_TRUE(torch::equal(flat_copies(s), sharded.to(torch::kBFloat16))) << "rank " << r << ": the copies are the masters rounded";
        std::pair<size_t, size_t> released{0, 0};
        for (const auto& [a, b] : spans_outside({{0, total}}, p.plan.ranges_of(r)))
          for (const auto& v : s.optimizer().param_views(a, b)) {
            const auto n = testing::interior_pages(v.data_ptr(), v.numel() * static_cast<int64_t>(v.element_size()));
            released.first += n.first;
            released.second += n.second;
          }
        EXPECT_GT(released.second, 8u);
        EXPECT_EQ(released.first, 0u) << "rank " << r << ": masters it does not hold are resident";
      }
    }
  }
}

// fp32 over Gloo: Gloo's ring allreduce (zero=0) and the zero scatter add
// the ranks in different orders, so results differ in rounding only: every
// zero=2 rank agrees bit for bit with the others, the parameters stay
// within rounding of zero=0's, and the clipping norm from the shards'
// partial sums is the global norm (clipping on, as by default).
TEST(Zero2, Fp32OverGlooDiffersFromZeroZeroInRoundingOnly) {
  run_how h;
  auto p = run_pair({}, 3, 2, 4, h);
  const std::string mine = p.sharded[0]->params_digest();
  for (int r = 1; r < 3; ++r) EXPECT_EQ(p.sharded[static_cast<size_t>(r)]->params_digest(), mine) << "rank " << r;
  ASSERT_EQ(p.plain_norms.size(), p.sharded_norms.size());
  for (size_t i = 0; i < p.plain_norms.size(); ++i) {
    EXPECT_GT(p.plain_norms[i], 0);
    EXPECT_NEAR(p.sharded_norms[i], p.plain_norms[i], 1e-5 * p.plain_norms[i]) << "step " << i;
  }
  double largest = 0, total = 0;
  int64_t n = 0;
  auto a = p.plain[0]->the_task().module()->parameters(), b = p.sharded[0]->the_task().module()->parameters();
  for (size_t i = 0; i < a.size(); ++i) {
    auto d = (a[i] - b[i]).abs();
    largest = std::max(largest, d.max().item<double>());
    total += d.sum().item<double>();
    n += d.numel();
  }
  std::printf("zero=2 vs zero=0 over Gloo, 4 steps: largest parameter difference %.3g, mean %.3g\n", largest, total / n);
  // Adam moves a parameter by about lr (0.003) a step whatever the
  // gradient's size, so an element whose gradient is near zero can move
  // differently; the rest agree to rounding.
  EXPECT_LT(largest, 0.003);
  EXPECT_LT(total / n, 1e-6);
}

// One step over Gloo (the gradients reduce-scattered with `zero2`, else
// allreduced as at zero = 1) in which the gradient-norm allreduce completes
// on every rank but `failing` sees it fail (as when a peer dies inside the
// collective: Gloo's ring lets some ranks finish and not others): the other
// ranks step their shards, then their parameter all-gather fails (the peer
// is gone). Returns every rank's error.
std::vector<std::string> interrupted_step(std::vector<std::unique_ptr<training_state>>& states, int world, const shard_plan& plan, int failing,
                                          bool zero2) {
  return run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    grad_sync_options o = buckets();
    o.carry_control = true;
    if (zero2) o.zero2 = zero2_of(s.optimizer(), plan);
    grad_sync sync(s.the_task().module()->parameters(), pg, o);
    sync.set_parameter_sync(std::make_unique<interrupted_sync>(zero_sync_over_group(s.optimizer(), plan, zero_sync(pg, true)),
                                                               rank == failing));
    auto r = s.train_step(step_context::every_step(rank, world, sync));
    return r ? "" : r.message();
  });
}

// Ranks 0 and 1 of `states` as the next generation's group under `plan`:
// with `finish`, finish_interrupted_step first (else a rank drops what it
// kept), then the reshard. Returns whether each finished a step, and the
// reshard's verdict ("" or what is missing) through `missing`.
std::vector<int> next_generation(std::vector<std::unique_ptr<training_state>>& states, const shard_plan& plan, bool finish,
                                 std::vector<std::string>* missing) {
  std::vector<int> finished(2, 0);
  missing->assign(2, "");
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    if (auto e = testing::finish_or_drop(*pg, s, finish, &finished[static_cast<size_t>(rank)]); !e.empty()) return e;
    // Every survivor holds the highest step here (agree_state's broadcast
    // would bring a lagging one up to it).
    const bool current = s.step() == std::max(states[0]->step(), states[1]->step());
    auto r = reshard_optimizer(*pg, s.optimizer(), plan, current, s.params_mixed(), std::chrono::milliseconds(20000), {});
    if (!r) return r.message();
    (*missing)[static_cast<size_t>(rank)] = r->complete ? "" : r->missing;
    if (r->complete) s.clear_params_mixed();
    return "";
  }));
  return finished;
}

// The test below at train.zero = `level` (1 or 2).
void interrupted_at_level(int level) {
  const bool zero2 = level >= 2;
  const int steps = 2;
  run_how h;  // Gloo, fp32
  const auto cfg = tiny_vit_config({"train.zero=" + std::to_string(level)});
  auto ref = make_states(cfg, 3), cut = make_states(cfg, 3), dropped = make_states(cfg, 3);
  const int64_t total = ref[0]->optimizer().total_elements();
  const auto plan3 = make_shard_plan(total, nodes_of(3), 2);
  const auto plan2 = make_shard_plan(total, nodes_of(2), 2);
  // Shard 1 is held by ranks 1 and 2: with rank 2 lost, rank 1 is its only holder.
  ASSERT_EQ(plan3.shards[1].holders, (std::vector<int>{1, 2}));
  for (auto* v : {&ref, &cut, &dropped})
    for (int r = 0; r < 3; ++r) (*v)[static_cast<size_t>(r)]->shard_optimizer(plan3.ranges_of(r));
  expect_no_errors(train_how(ref, 3, steps + 1, &plan3, zero2, h));
  for (auto* v : {&cut, &dropped}) {
    expect_no_errors(train_how(*v, 3, steps, &plan3, zero2, h));
    const auto errors = interrupted_step(*v, 3, plan3, 1, zero2);
    for (int r = 0; r < 3; ++r) EXPECT_FALSE(errors[static_cast<size_t>(r)].empty()) << "rank " << r;
    EXPECT_EQ((*v)[0]->step(), steps + 1);
    EXPECT_EQ((*v)[1]->step(), steps);
    EXPECT_EQ((*v)[2]->step(), steps + 1);
    EXPECT_TRUE((*v)[1]->has_interrupted_step());
    EXPECT_TRUE((*v)[0]->params_mixed());
  }
  // Rank 2 is gone. Dropping the interrupted step loses shard 1's state.
  std::vector<std::string> missing;
  next_generation(dropped, plan2, false, &missing);
  EXPECT_NE(missing[0].find("[" + std::to_string(plan3.shards[1].begin) + ", "), std::string::npos) << missing[0];
  // Finishing it: nothing is missing, and the state is the uninterrupted one.
  EXPECT_EQ(next_generation(cut, plan2, true, &missing), (std::vector<int>{0, 1}));
  EXPECT_EQ(missing, (std::vector<std::string>{"", ""}));
  EXPECT_EQ(cut[1]->step(), steps + 1);
  EXPECT_FALSE(cut[1]->has_interrupted_step());
  next_generation(ref, plan2, true, &missing);
  EXPECT_EQ(missing, (std::vector<std::string>{"", ""}));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(cut[static_cast<size_t>(r)]->params_digest(), ref[0]->params_digest()) << "rank " << r;
  expect_no_errors(train_how(ref, 2, 2, &plan2, zero2, h));
  expect_no_errors(train_how(cut, 2, 2, &plan2, zero2, h));
  for (int r = 0; r < 2; ++r) EXPECT_EQ(cut[static_cast<size_t>(r)]->params_digest(), ref[0]->params_digest()) << "rank " << r;
  // The moments too: each survivor's windows equal the reference's.
  for (int r = 0; r < 2; ++r) {
    auto a = ref[static_cast<size_t>(r)]->state_tensors(), b = cut[static_cast<size_t>(r)]->state_tensors();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i].sharded) {
        EXPECT_TRUE(torch::equal(a[i].t, b[i].t)) << a[i].name << " rank " << r;
      }
    }
  }
}

// A rank whose norm allreduce failed while the others completed it and
// stepped: its shards would stay a step behind, and with the one other
// holder of a shard lost (a node gone) that shard's state would be lost
// (the job then went back to a checkpoint, or, with none, round the same
// failure forever). The lagging rank finishes the step from the gradient
// shards it kept and the norm the others used; the survivors reshard
// completely and train on exactly as after an uninterrupted step.
//
// At zero = 1 every rank holds the whole summed gradient, and the norm's
// allreduce runs all the same (the rank worker's param sync): it is the
// step's commit, so a rank whose gradient allreduce failed never steps
// while another does, and one whose norm allreduce failed finishes.
TEST(Zero2, AStepInterruptedOnOneRankIsFinishedThereAndNoShardIsLost) {
  for (int level : {1, 2}) {
    SCOPED_TRACE("train.zero=" + std::to_string(level));
    interrupted_at_level(level);
  }
}

// A world of one (no reducer): autograd's gradients go into the windows at
// the update; training equals the unsharded optimizer's bit for bit.
TEST(Zero2, WorldOfOneTrainsAsTheUnshardedOptimizer) {
  auto plain = make_states(tiny_vit_config(), 1);
  auto sharded = make_states(tiny_vit_config({"train.zero=2"}), 1);
  sharded[0]->shard_optimizer({{0, sharded[0]->optimizer().total_elements()}});
  ASSERT_TRUE(sharded[0]->optimizer().grads_sharded());
  for (int i = 0; i < 3; ++i) {
    testing::train_alone(*plain[0]);
    testing::train_alone(*sharded[0]);
  }
  EXPECT_EQ(sharded[0]->params_digest(), plain[0]->params_digest());
}

}  // namespace
}  // namespace dtactor
