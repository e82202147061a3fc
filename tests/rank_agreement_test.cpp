// The rank layer's pure pieces: the generation's state agreement (its
// words and their MAX), DiLoCo's replay of a lost worker's slices, and the
// step cadence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "rank/agreement.hpp"
#include "rank/step_policy.hpp"
#include "rank/sync_diloco.hpp"

using namespace dtactor;

namespace {
std::vector<int64_t> elementwise_max(const std::vector<std::vector<int64_t>>& all) {
  std::vector<int64_t> m = all.front();
  for (const auto& v : all)
    for (size_t i = 0; i < m.size(); ++i) m[i] = std::max(m[i], v[i]);
  return m;
}
}  // namespace

// Three workers trained steps 10..13 at world 3; worker 2 is lost. The two
// survivors agree on what nobody holds (worker 2's slices) and deal them
// between themselves, each once.
TEST(diloco_replay, a_lost_workers_slices_are_dealt_once_over_the_survivors) {
  const window_span w{10, 14};
  std::vector<std::vector<window_slice>> held(2);
  for (int r = 0; r < 2; ++r)
    for (int64_t s = 10; s < 14; ++s) held[static_cast<size_t>(r)].push_back({s, r, 3, {}});
  std::vector<std::vector<int64_t>> worlds_in, bits_in;
  for (const auto& h : held) worlds_in.push_back(slice_world_words(h, w));
  const auto worlds = elementwise_max(worlds_in);
  EXPECT_EQ(worlds, (std::vector<int64_t>{3, 3, 3, 3, 3}));
  for (const auto& h : held) bits_in.push_back(slice_fragment_words(h, w, worlds, 1));
  const auto bits = elementwise_max(bits_in);
  std::vector<int64_t> steps;
  for (int r = 0; r < 2; ++r) {
    const auto dealt = deal_owed_slices(w, worlds, bits, {10}, replay_unit{2, r, 0, 1});
    EXPECT_EQ(dealt.owed, 4);
    for (const auto& x : dealt.mine) {
      EXPECT_EQ(x.rank, 2);
      EXPECT_EQ(x.world, 3);
      EXPECT_TRUE(x.fragments.empty());
      steps.push_back(x.step);
    }
  }
  std::sort(steps.begin(), steps.end());
  EXPECT_EQ(steps, (std::vector<int64_t>{10, 11, 12, 13}));
}

// Streaming: a slice of a step before a fragment's anchor is in that
// fragment already, so it is owed to the other fragments only; a step
// nobody alive trained is owed whole, as world 1.
TEST(diloco_replay, a_slice_before_a_fragments_anchor_is_owed_to_the_other_fragments_only) {
  const window_span w{10, 13};
  // One survivor, rank 0 of world 2 at steps 10 and 11; step 12 nobody reached.
  const std::vector<window_slice> held{{10, 0, 2, {}}, {11, 0, 2, {}}};
  const auto worlds = slice_world_words(held, w);
  EXPECT_EQ(worlds, (std::vector<int64_t>{2, 2, 0, 2}));
  const auto bits = slice_fragment_words(held, w, worlds, 2);
  const auto dealt = deal_owed_slices(w, worlds, bits, {10, 11}, replay_unit{1, 0, 0, 1});
  ASSERT_EQ(dealt.mine.size(), 3u);
  EXPECT_EQ(dealt.mine[0].step, 10);  // rank 1's slice, fragment 0 only (fragment 1's anchor is 11)
  EXPECT_EQ(dealt.mine[0].rank, 1);
  EXPECT_EQ(dealt.mine[0].fragments, (std::vector<bool>{true, false}));
  EXPECT_EQ(dealt.mine[1].step, 11);
  EXPECT_TRUE(dealt.mine[1].fragments.empty());
  EXPECT_EQ(dealt.mine[2].step, 12);
  EXPECT_EQ(dealt.mine[2].world, 1);
  EXPECT_TRUE(dealt.mine[2].fragments.empty());
}

// Hosts as workers: the units are the leaders, in the order of their rank.
TEST(diloco_replay, the_units_are_the_hosts_leaders_in_rank_order) {
  replay_unit u;
  count_units({1, 0, 1, 0, 0, 1}, 2, u);
  EXPECT_EQ(u.units, 3);
  EXPECT_EQ(u.unit, 1);
}

// A rank catching up holds the steps it will train, on the slicing of its
// segments.
TEST(diloco_replay, a_catching_up_rank_holds_the_steps_it_will_train) {
  const auto held = held_slices({{9, 0, 2, {}}, {10, 0, 2, {}}}, {{12, 1, 3}, {14, 0, 2}}, 11, window_span{10, 13});
  ASSERT_EQ(held.size(), 3u);
  EXPECT_EQ(held[0].step, 10);
  EXPECT_EQ(held[1].step, 11);
  EXPECT_EQ(held[1].rank, 1);
  EXPECT_EQ(held[1].world, 3);
  EXPECT_EQ(held[2].step, 12);
  EXPECT_EQ(held[2].world, 2);
}

TEST(agreement, the_highest_step_wins_and_its_lowest_holder_is_the_root) {
  // Ranks 0..3 hold steps 7, 9, 9, 3.
  const std::vector<int64_t> steps{7, 9, 9, 3};
  int64_t w0 = INT64_MIN, w1 = INT64_MIN;
  for (int r = 0; r < 4; ++r) {
    auto [a, b] = agreement_words(steps[r], r);
    w0 = std::max(w0, a);
    w1 = std::max(w1, b);
  }
  auto a = read_agreement(w0, w1);
  EXPECT_EQ(a.max_step, 9);
  EXPECT_EQ(a.root, 1);
  EXPECT_EQ(a.min_step, 3);
  EXPECT_FALSE(a.everyone_holds_it());
}

// The generation's one round: every piece's words side by side, reduced
// together, each read back from its own slot.
TEST(agreement, one_round_carries_every_pieces_words_and_each_reads_its_own) {
  // Ranks 0..2: rank 0 read the plan's checkpoint at step 40 and the others
  // hold 40 (DiLoCo anchors); their windows reached 40+3, 40+7, 40+5, and
  // rank 2 trained in generation 4, the others in 3.
  const std::vector<int64_t> anchors{40, 40, 40}, steps{43, 47, 45}, trained{3, 3, 4};
  std::vector<int64_t> reduced;
  agreement_round::slot state_slot, disk_slot, window_slot;
  for (int r = 0; r < 3; ++r) {
    agreement_round round;
    const auto [w0, w1] = agreement_words(anchors[r], r);
    state_slot = round.add({w0, w1});
    disk_slot = round.add({disk_word(r == 0, anchors[r])});
    window_slot = round.add({*window_word(anchors[r], steps[r]), trained[r]});
    if (reduced.empty()) reduced = round.words();
    for (size_t i = 0; i < reduced.size(); ++i) reduced[i] = std::max(reduced[i], round.words()[i]);
  }
  agreement_round out;
  out.add(reduced);
  const auto st = out.read(state_slot);
  const auto a = read_agreement(st[0], st[1]);
  EXPECT_TRUE(a.everyone_holds_it());
  EXPECT_EQ(a.root, 0);
  EXPECT_TRUE(agreed_from_disk(out.read(disk_slot)[0], a));
  const auto w = out.read(window_slot);
  EXPECT_EQ(furthest_of_window_word(w[0]), 47);
  EXPECT_EQ(w[1], 4);
}

// The shards come from the checkpoint only when the agreed state is the one
// rank 0 read from it: a peer holding a newer step wins over the disk.
TEST(agreement, a_newer_step_held_by_a_peer_is_not_from_disk) {
  const auto [a0, b0] = agreement_words(40, 0);
  const auto [a1, b1] = agreement_words(52, 1);
  const auto a = read_agreement(std::max(a0, a1), std::max(b0, b1));
  EXPECT_EQ(a.max_step, 52);
  EXPECT_FALSE(agreed_from_disk(std::max(disk_word(true, 40), disk_word(false, 52)), a));
  EXPECT_FALSE(agreed_from_disk(disk_word(false, 52), a));
}

// A window word orders by anchor first: a rank behind the highest anchor
// (it starts its window over from it) never sets the furthest step, however
// far its own window went.
TEST(agreement, the_furthest_window_step_is_a_holder_of_the_highest_anchors) {
  const auto behind = window_word(20, 39);  // anchor 20, 19 steps on
  const auto ahead = window_word(40, 42);   // anchor 40, 2 steps on
  ASSERT_TRUE(behind && ahead);
  EXPECT_EQ(furthest_of_window_word(std::max(*behind, *ahead)), 42);
  EXPECT_EQ(furthest_of_window_word(*window_word(0, 0)), 0);
  // A window of 2^20 steps or more, or steps before the anchor, cannot be agreed.
  EXPECT_FALSE(window_word(10, 10 + (int64_t{1} << window_offset_bits)).has_value());
  EXPECT_TRUE(window_word(10, 10 + (int64_t{1} << window_offset_bits) - 1).has_value());
  EXPECT_FALSE(window_word(10, 9).has_value());
}

TEST(agreement, everyone_at_the_same_step_takes_nothing_and_rank_0_is_the_root) {
  int64_t w0 = INT64_MIN, w1 = INT64_MIN;
  for (int r = 0; r < 3; ++r) {
    auto [a, b] = agreement_words(120000, r);
    w0 = std::max(w0, a);
    w1 = std::max(w1, b);
  }
  auto a = read_agreement(w0, w1);
  EXPECT_TRUE(a.everyone_holds_it());
  EXPECT_EQ(a.max_step, 120000);
  EXPECT_EQ(a.root, 0);
}

TEST(step_cadence, every_n_steps_and_always_at_the_last) {
  step_cadence c;
  c.max_steps = 10;
  c.eval_every = 4;
  c.checkpoint_every = 0;
  EXPECT_TRUE(c.eval_due(4));
  EXPECT_FALSE(c.eval_due(5));
  EXPECT_TRUE(c.eval_due(10));
  EXPECT_FALSE(c.checkpoint_due(4));
  EXPECT_TRUE(c.checkpoint_due(10));
}
