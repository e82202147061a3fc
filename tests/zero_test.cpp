// train.zero = 1: the shard plan, the sharded optimizer's steps against the
// replicated one (bit for bit), the reshard when a rank is lost, and the
// checkpoint ranges each rank writes. Ranks are threads over Gloo.
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
#include "rank_threads.hpp"
#include "comm/grad_sync.hpp"
#include "comm/step_control.hpp"
#include "test_util.hpp"
#include "zero_test_util.hpp"

namespace dtactor {
namespace {

using namespace zero_test;

TEST(ShardPlan, ShardsCoverTheIndexSpaceAndReplicasGoToAnotherNode) {
  for (int64_t total : {0L, 1L, 63L, 64L, 1000L, 12345L}) {
    const std::vector<std::string> nodes = {"a", "a", "b", "b"};
    const auto p = make_shard_plan(total, nodes, 2);
    ASSERT_EQ(p.world(), 4);
    int64_t at = 0;
    for (int s = 0; s < 4; ++s) {
      const auto& sh = p.shards[static_cast<size_t>(s)];
      EXPECT_EQ(sh.begin, at) << total;
      EXPECT_GE(sh.end, sh.begin);
      if (s < 3 && sh.end < total) {
        EXPECT_EQ(sh.end % 64, 0) << "aligned";
      }
      at = sh.end;
      ASSERT_EQ(sh.holders.size(), 2u);
      EXPECT_EQ(sh.holders[0], s) << "rank s is shard s's primary";
      EXPECT_NE(nodes[static_cast<size_t>(sh.holders[1])], nodes[static_cast<size_t>(s)]) << "the replica is on another node";
    }
    EXPECT_EQ(at, total);
  }
  // 2 + 2 ranks: each rank holds two shards, 1/2 of the state.
  const auto p = make_shard_plan(4096, {"a", "a", "b", "b"}, 2);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(p.held_elements(r), 2048) << r;
  EXPECT_EQ(p.shards[0].holders, (std::vector<int>{0, 2}));
  EXPECT_EQ(p.shards[1].holders, (std::vector<int>{1, 3}));
  EXPECT_EQ(p.shards[2].holders, (std::vector<int>{2, 0}));
  EXPECT_EQ(p.shards[3].holders, (std::vector<int>{3, 1}));
  // One node: the next rank; replicas clamped to the world.
  const auto one = make_shard_plan(100, {"a", "a", "a"}, 5);
  EXPECT_EQ(one.shards[2].holders, (std::vector<int>{2, 0, 1}));
  EXPECT_EQ(default_replicas({"a", "a"}), 1);
  EXPECT_EQ(default_replicas({"a", "b"}), 2);
}

// Three holders with 3 nodes or more: one a node, so any two lost machines
// leave a copy of every shard (the second replica once went to the fewest-
// loaded rank of any node but the primary's, possibly beside the first);
// every rank still holds R shards. With 2 nodes the third holder shares a
// node, as before.
TEST(ShardPlan, RHoldersGoToRNodesWhenThereAreThatMany) {
  for (const std::vector<std::string>& nodes : {std::vector<std::string>{"a", "a", "b", "b", "c", "c"},
                                                 std::vector<std::string>{"a", "b", "c", "d", "e"},
                                                 std::vector<std::string>{"a", "a", "a", "b", "c", "c"}}) {
    const auto p = make_shard_plan(6000, nodes, 3);
    std::vector<int> load(nodes.size(), 0);
    for (const auto& sh : p.shards) {
      ASSERT_EQ(sh.holders.size(), 3u);
      std::set<std::string> on;
      for (int h : sh.holders) on.insert(nodes[static_cast<size_t>(h)]), ++load[static_cast<size_t>(h)];
      EXPECT_EQ(on.size(), 3u) << "shard " << sh.begin << ": holders on " << on.size() << " nodes";
    }
    if (nodes[0] != nodes[2]) {  // equal nodes: every rank holds R shards
      for (size_t r = 0; r < nodes.size(); ++r) EXPECT_EQ(load[r], 3) << "rank " << r;
    }
  }
  const auto two = make_shard_plan(4000, {"a", "a", "b", "b"}, 3);
  for (const auto& sh : two.shards) {
    std::set<int> distinct(sh.holders.begin(), sh.holders.end());
    EXPECT_EQ(distinct.size(), 3u);
  }
}

TEST(Zero, ShardedOptimizerStepsEqualTheReplicatedOnesBitForBit) {
  const int world = 3, steps = 4;
  auto cfg = tiny_vit_config();
  auto plain = make_states(cfg, world);
  auto sharded = make_states(cfg, world);
  const auto plan = make_shard_plan(sharded[0]->optimizer().total_elements(), nodes_of(world), 2);
  for (int r = 0; r < world; ++r) sharded[static_cast<size_t>(r)]->shard_optimizer(plan.ranges_of(r));
  expect_no_errors(train(plain, world, steps, nullptr));
  expect_no_errors(train(sharded, world, steps, &plan));
  const std::string want = plain[0]->params_digest();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(sharded[static_cast<size_t>(r)]->params_digest(), want) << "rank " << r;
    EXPECT_EQ(sharded[static_cast<size_t>(r)]->step(), steps);
    // What it holds: its shards' moments only (two floats an element).
    EXPECT_EQ(sharded[static_cast<size_t>(r)]->optimizer().state_bytes(), 8 * plan.held_elements(r));
    EXPECT_LT(sharded[static_cast<size_t>(r)]->optimizer().state_bytes(), plain[0]->optimizer().state_bytes());
  }
  // The moments match the replicated optimizer's where held.
  auto full = plain[0]->state_tensors();
  for (int r = 0; r < world; ++r)
    for (const auto& w : sharded[static_cast<size_t>(r)]->state_tensors()) {
      if (!w.sharded || w.t.numel() == 0) continue;
      const auto it = std::find_if(full.begin(), full.end(), [&](const state_tensor& f) { return f.name == w.name; });
      ASSERT_NE(it, full.end());
      EXPECT_TRUE(torch::equal(it->t.narrow(0, w.first, w.t.numel()), w.t)) << w.name << " rank " << r;
    }
}

// A rank is lost after some steps: the two survivors reshard (each takes the
// lost rank's shards from their replicas) and train on at world 2, ending
// exactly where a replicated job that went from 3 to 2 ranks ends.
TEST(Zero, SurvivorsReshardFromTheReplicasAndGoOnExactly) {
  const int steps = 3;
  auto cfg = tiny_vit_config();
  auto plain = make_states(cfg, 3);
  auto sharded = make_states(cfg, 3);
  const auto plan3 = make_shard_plan(sharded[0]->optimizer().total_elements(), nodes_of(3), 2);
  for (int r = 0; r < 3; ++r) sharded[static_cast<size_t>(r)]->shard_optimizer(plan3.ranges_of(r));
  expect_no_errors(train(plain, 3, steps, nullptr));
  expect_no_errors(train(sharded, 3, steps, &plan3));
  // Rank 2 is gone, and rank 1's last all-gather failed half-way: its
  // parameters of a shard it does not hold are a mix (here: garbage).
  ASSERT_EQ(plan3.held_by(1), (std::vector<int>{0, 1}));
  {
    torch::NoGradGuard no_grad;
    for (auto& v : sharded[1]->optimizer().param_views(plan3.shards[2].begin, plan3.shards[2].end)) v.fill_(7.0f);
  }
  const auto plan2 = make_shard_plan(sharded[0]->optimizer().total_elements(), nodes_of(2), 2);
  std::vector<reshard_result> got(2);
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto r = reshard_optimizer(*pg, sharded[static_cast<size_t>(rank)]->optimizer(), plan2, true, rank == 1, std::chrono::milliseconds(20000), {});
    if (!r) return r.message();
    got[static_cast<size_t>(rank)] = r.value();
    return r->complete ? "" : "incomplete: " + r->missing;
  }));
  EXPECT_GT(got[0].moments_in + got[1].moments_in, 0u) << "the lost rank's shards came from their replicas";
  EXPECT_EQ(sharded[1]->params_digest(), sharded[0]->params_digest()) << "rank 1's mixed parameters repaired from the holders";
  for (int r = 0; r < 2; ++r) EXPECT_EQ(sharded[static_cast<size_t>(r)]->optimizer().held_ranges(), plan2.ranges_of(r));
  expect_no_errors(train(plain, 2, steps, nullptr));
  expect_no_errors(train(sharded, 2, steps, &plan2));
  EXPECT_EQ(sharded[0]->params_digest(), plain[0]->params_digest());
  EXPECT_EQ(sharded[1]->params_digest(), plain[0]->params_digest());
}

// Without replicas, a lost rank takes its shard with it: the reshard says
// which elements nobody holds and changes nothing (the caller goes to a
// checkpoint).
TEST(Zero, AShardHeldByNobodyIsReportedAndNothingMoves) {
  auto cfg = tiny_vit_config();
  auto states = make_states(cfg, 3);
  const int64_t total = states[0]->optimizer().total_elements();
  const auto plan3 = make_shard_plan(total, nodes_of(3), 1);
  for (int r = 0; r < 3; ++r) states[static_cast<size_t>(r)]->shard_optimizer(plan3.ranges_of(r));
  const auto plan2 = make_shard_plan(total, nodes_of(2), 1);
  std::vector<reshard_result> got(2);
  expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto r = reshard_optimizer(*pg, states[static_cast<size_t>(rank)]->optimizer(), plan2, true, false, std::chrono::milliseconds(20000), {});
    if (!r) return r.message();
    got[static_cast<size_t>(rank)] = r.value();
    return "";
  }));
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE(got[static_cast<size_t>(r)].complete);
    EXPECT_EQ(got[static_cast<size_t>(r)].missing,
              "elements [" + std::to_string(plan3.shards[2].begin) + ", " + std::to_string(plan3.shards[2].end) + ")");
    EXPECT_EQ(states[static_cast<size_t>(r)]->optimizer().held_ranges(), plan3.ranges_of(r)) << "unchanged";
  }
}

// The reshard in two halves (healing while the first step trains): the
// plan on each rank's thread, the moves on another thread. A plan called
// off before its moves gives back the windows held before, untouched; a
// plan whose moves ran ends where reshard_optimizer ends: the survivors
// train on exactly as the replicated job.
TEST(Zero, AReshardPlannedThenMovedOnAnotherThreadGoesOnExactly) {
  const int steps = 3;
  auto cfg = tiny_vit_config();
  auto plain = make_states(cfg, 3);
  auto sharded = make_states(cfg, 3);
  const int64_t total = sharded[0]->optimizer().total_elements();
  const auto plan3 = make_shard_plan(total, nodes_of(3), 2);
  for (int r = 0; r < 3; ++r) sharded[static_cast<size_t>(r)]->shard_optimizer(plan3.ranges_of(r));
  expect_no_errors(train(plain, 3, steps, nullptr));
  expect_no_errors(train(sharded, 3, steps, &plan3));
  auto moments_of = [](training_state& s) {
    std::vector<torch::Tensor> out;
    for (const auto& t : s.state_tensors())
      if (t.sharded) out.push_back(t.t.clone());
    return out;
  };
  std::vector<std::vector<torch::Tensor>> before;
  for (int r = 0; r < 2; ++r) before.push_back(moments_of(*sharded[static_cast<size_t>(r)]));
  const auto plan2 = make_shard_plan(total, nodes_of(2), 2);
  for (bool call_off : {true, false}) {
    SCOPED_TRACE(call_off ? "called off" : "moved");
    std::vector<reshard_plan> got(2);
    expect_no_errors(run_ranks(2, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
      flat_adamw& opt = sharded[static_cast<size_t>(rank)]->optimizer();
      auto p = plan_reshard(*pg, opt, plan2, true, std::chrono::milliseconds(20000), {}, 1 << 24);
      if (!p) return p.message();
      if (!p->totals.complete) return "incomplete: " + p->totals.missing;
      if (opt.held_ranges() != plan2.ranges_of(rank)) return "the plan did not make the new windows";
      got[static_cast<size_t>(rank)] = p.value();
      if (call_off) {
        opt.restore_retired();
        return "";
      }
      status moved;
      // Through memory (threads of one process read each other).
      auto peers = local_peers::agree(*pg, std::chrono::steady_clock::now() + std::chrono::seconds(20), {});
      if (!peers) return peers.message();
      const p2p_waits waits{nullptr, [](const c10::intrusive_ptr<c10d::Work>& w, const std::string&) -> status {
                              w->wait(std::chrono::milliseconds(20000));
                              return {};
                            }};
      std::thread t([&] { moved = run_moves(*pg, got[static_cast<size_t>(rank)].moves, peers.value(), waits); });
      t.join();
      if (!moved) return moved.message();
      opt.drop_retired();
      return "";
    }));
    EXPECT_GT(got[0].totals.moments_in + got[1].totals.moments_in, 0u) << "the lost rank's shards come from their replicas";
    for (int r = 0; r < 2; ++r) {
      const auto& want = call_off ? plan3.ranges_of(r) : plan2.ranges_of(r);
      EXPECT_EQ(sharded[static_cast<size_t>(r)]->optimizer().held_ranges(), want) << "rank " << r;
      if (!call_off) continue;
      const auto now = moments_of(*sharded[static_cast<size_t>(r)]);
      ASSERT_EQ(now.size(), before[static_cast<size_t>(r)].size());
      for (size_t i = 0; i < now.size(); ++i) EXPECT_TRUE(torch::equal(now[i], before[static_cast<size_t>(r)][i])) << "rank " << r << " tensor " << i;
    }
  }
  expect_no_errors(train(plain, 2, steps, nullptr));
  expect_no_errors(train(sharded, 2, steps, &plan2));
  EXPECT_EQ(sharded[0]->params_digest(), plain[0]->params_digest());
  EXPECT_EQ(sharded[1]->params_digest(), plain[0]->params_digest());
}

// Each rank writes its share of the replicated bytes and the windows of the
// shards it is the primary of: over all ranks, the stream exactly once, and
// every range inside what the rank holds.
TEST(Zero, CheckpointRangesCoverTheStreamOnceAndAreHeldByTheirWriter) {
  const int world = 3;
  auto cfg = tiny_vit_config();
  auto states = make_states(cfg, world);
  const int64_t total = states[0]->optimizer().total_elements();
  const auto plan = make_shard_plan(total, nodes_of(world), 2);
  for (int r = 0; r < world; ++r) states[static_cast<size_t>(r)]->shard_optimizer(plan.ranges_of(r));
  std::vector<std::pair<uint64_t, uint64_t>> all;
  uint64_t bytes = 0;
  for (int r = 0; r < world; ++r) {
    const auto layout = layout_of(*states[static_cast<size_t>(r)]);
    EXPECT_TRUE(layout.sharded());
    bytes = layout.bytes;
    const auto& sh = plan.shards[static_cast<size_t>(r)];
    rank_share share;
    share.rank = r;
    share.world = world;
    share.primary = {{sh.begin, sh.end}};
    share.held = plan.ranges_of(r);
    const auto ranges = save_ranges(layout, share, states[static_cast<size_t>(r)]->optimizer().group_bases());
    for (const auto& [a, b] : ranges) {
      // Inside the rank's entries.
      uint64_t covered = 0;
      for (const auto& e : layout.entries)
        covered += std::min(b, e.offset + e.size) > std::max(a, e.offset) ? std::min(b, e.offset + e.size) - std::max(a, e.offset) : 0;
      EXPECT_EQ(covered, b - a) << "rank " << r << " writes [" << a << ", " << b << ") it does not hold";
      all.emplace_back(a, b);
    }
  }
  std::sort(all.begin(), all.end());
  uint64_t at = 0;
  for (const auto& [a, b] : all) {
    EXPECT_EQ(a, at) << "gap or overlap";
    at = b;
  }
  EXPECT_EQ(at, bytes);
  // Unsharded, one range per rank: today's part_range.
  auto plain = make_states(cfg, 1);
  const auto layout = layout_of(*plain[0]);
  rank_share second;
  second.rank = 1;
  second.world = 2;
  EXPECT_EQ(save_ranges(layout, second, plain[0]->optimizer().group_bases()),
            (std::vector<std::pair<uint64_t, uint64_t>>{part_range(layout.bytes, 1, 2)}));
}

}  // namespace
}  // namespace dtactor
