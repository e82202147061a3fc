#include "model/data_order.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>

namespace dtactor {
namespace {

TEST(DataOrder, EachEpochIsAPermutation) {
  for (int64_t n : {1, 2, 7, 100, 1000, 60000}) {
    data_order o(42, n, 16);
    std::vector<int64_t> seen;
    for (int64_t p = 0; p < n; ++p) seen.push_back(o.sample_at(p));
    std::sort(seen.begin(), seen.end());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[i], i) << "n=" << n;
  }
}

TEST(DataOrder, PureFunctionOfSeedStepAndBatch) {
  data_order a(7, 1000, 32), b(7, 1000, 32), c(8, 1000, 32);
  EXPECT_EQ(a.global_batch(123), b.global_batch(123));
  EXPECT_NE(a.global_batch(123), c.global_batch(123));
  // Order of queries does not matter (no hidden state).
  auto later = a.global_batch(500);
  a.global_batch(3);
  EXPECT_EQ(a.global_batch(500), later);
}

TEST(DataOrder, EpochsDiffer) {
  data_order o(1, 100, 10);
  std::vector<int64_t> e0, e1;
  for (int64_t p = 0; p < 100; ++p) e0.push_back(o.sample_at(p)), e1.push_back(o.sample_at(100 + p));
  EXPECT_NE(e0, e1);
}

TEST(DataOrder, RankSlicesConcatenateToTheGlobalBatch) {
  data_order o(3, 60000, 128);
  for (int world : {1, 2, 3, 4, 5, 7}) {
    for (int64_t step : {0, 1, 468, 469, 10000}) {
      std::vector<int64_t> joined;
      for (int r = 0; r < world; ++r) {
        auto s = o.rank_slice(step, r, world);
        joined.insert(joined.end(), s.begin(), s.end());
      }
      EXPECT_EQ(joined, o.global_batch(step)) << "world " << world << " step " << step;
    }
  }
}

TEST(DataOrder, SplitRangeIsBalanced) {
  EXPECT_EQ(split_range(10, 0, 3), (std::pair<int64_t, int64_t>{0, 4}));
  EXPECT_EQ(split_range(10, 1, 3), (std::pair<int64_t, int64_t>{4, 7}));
  EXPECT_EQ(split_range(10, 2, 3), (std::pair<int64_t, int64_t>{7, 10}));
}

TEST(DataOrder, RejectsEmptyInputs) {
  EXPECT_THROW(data_order(1, 0, 4), std::invalid_argument);
  EXPECT_THROW(data_order(1, 10, 0), std::invalid_argument);
}

// -- sharded data (docs/data.md, "The order") ---------------------------------

shard_layout layout(std::vector<int64_t> samples, int64_t block) { return shard_layout{std::move(samples), block}; }

// Which block (of the epoch's shard sequence) each shard is in.
std::map<int64_t, int64_t> block_of_shard(const data_order& o, int64_t epoch, int64_t shards, int64_t block) {
  // shards_from at the epoch's first position lists the epoch's shard sequence.
  auto seq = o.shards_from(epoch * o.dataset_size(), shards);
  std::map<int64_t, int64_t> out;
  for (size_t k = 0; k < seq.size(); ++k) out[seq[k]] = static_cast<int64_t>(k) / block;
  return out;
}

TEST(ShardedDataOrder, EachEpochIsAPermutationOfEverySampleOfEveryShard) {
  for (auto [samples, block] : std::vector<std::pair<std::vector<int64_t>, int64_t>>{
           {{5}, 1}, {{1, 1, 1}, 2}, {{10, 3, 7, 1, 20}, 2}, {{100, 90, 110, 95, 100, 105, 99}, 3}, {std::vector<int64_t>(40, 25), 4},
           {{13, 17}, 8}}) {
    data_order o(11, layout(samples, block), 8);
    const int64_t n = o.dataset_size();
    ASSERT_EQ(n, std::accumulate(samples.begin(), samples.end(), int64_t{0}));
    for (int64_t epoch : {0, 1, 5}) {
      std::vector<int64_t> seen;
      for (int64_t p = epoch * n; p < (epoch + 1) * n; ++p) seen.push_back(o.sample_at(p));
      std::sort(seen.begin(), seen.end());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], i) << "epoch " << epoch << ", " << samples.size() << " shards";
    }
  }
}

TEST(ShardedDataOrder, APositionReadsFromItsBlocksShardsOnlyAndBlocksComeInTurn) {
  const std::vector<int64_t> samples{30, 20, 40, 25, 35, 30, 20, 45, 30, 25};
  const int64_t block = 3;
  data_order o(5, layout(samples, block), 16);
  const int64_t n = o.dataset_size();
  for (int64_t epoch : {0, 1}) {
    auto blocks = block_of_shard(o, epoch, static_cast<int64_t>(samples.size()), block);
    ASSERT_EQ(blocks.size(), samples.size());
    int64_t last_block = 0;
    for (int64_t p = epoch * n; p < (epoch + 1) * n; ++p) {
      const int64_t b = blocks.at(o.shard_of(o.sample_at(p)));
      ASSERT_GE(b, last_block) << "position " << p << " went back to an earlier block";
      last_block = b;
    }
    EXPECT_EQ(last_block, (static_cast<int64_t>(samples.size()) + block - 1) / block - 1);
  }
}

TEST(ShardedDataOrder, SamplesAreShuffledAcrossTheShardsOfABlock) {
  // Not shard after shard: within a block's first positions, several shards.
  data_order o(3, layout(std::vector<int64_t>(8, 1000), 4), 64);
  std::set<int64_t> shards;
  for (int64_t p = 0; p < 64; ++p) shards.insert(o.shard_of(o.sample_at(p)));
  EXPECT_EQ(shards.size(), 4u) << "a step of 64 samples should mix the 4 shards of its block";
  // The shard order differs between epochs and seeds.
  EXPECT_NE(o.shards_from(0, 8), o.shards_from(o.dataset_size(), 8));
  data_order other(4, layout(std::vector<int64_t>(8, 1000), 4), 64);
  EXPECT_NE(o.shards_from(0, 8), other.shards_from(0, 8));
}

TEST(ShardedDataOrder, ShardsFromListsWhatTheNextStepsReadMostUrgentFirst) {
  const std::vector<int64_t> samples{30, 20, 40, 25, 35, 30, 20, 45, 30, 25};
  data_order o(9, layout(samples, 2), 16);
  const int64_t n = o.dataset_size();
  for (int64_t step : {0, 3, 10, 17, 25}) {
    const int64_t p = step * 16;
    auto ahead = o.shards_from(p, 6);  // this block and the next two
    ASSERT_EQ(ahead.size(), 6u);
    std::set<int64_t> listed(ahead.begin(), ahead.end());
    // Every sample of this step and the next one is in a listed shard.
    for (int64_t q = p; q < p + 32; ++q) EXPECT_TRUE(listed.count(o.shard_of(o.sample_at(q)))) << "step " << step << " position " << q;
    // The first listed shards hold this position's sample's block.
    auto first_two = std::set<int64_t>(ahead.begin(), ahead.begin() + 2);
    EXPECT_TRUE(first_two.count(o.shard_of(o.sample_at(p))));
  }
  // Crossing into the next epoch: the list goes on with its first block.
  auto tail = o.shards_from(n - 1, 4);
  ASSERT_EQ(tail.size(), 4u);
  auto next_epoch = o.shards_from(n, 2);
  EXPECT_EQ(std::vector<int64_t>(tail.begin() + 2, tail.end()), next_epoch);
}

// Exactly once per epoch whatever the cluster does: the world size changes
// between steps (a loss, a join, a resume at another world size) and each
// step's samples are the union of its ranks' slices.
TEST(ShardedDataOrder, EveryIndexExactlyOncePerEpochAcrossWorldSizeChanges) {
  const std::vector<int64_t> samples{64, 48, 80, 56, 72, 40, 64, 32};
  const int64_t batch = 24;
  data_order o(21, layout(samples, 3), batch);
  const int64_t n = o.dataset_size();
  ASSERT_EQ(n % batch, 0);  // so that steps tile the epoch
  const std::vector<int> worlds{4, 4, 3, 3, 3, 1, 2, 5, 5, 4};
  std::map<int64_t, int> count;
  for (int64_t step = 0; step < n / batch; ++step) {
    const int w = worlds[static_cast<size_t>(step) % worlds.size()];
    for (int r = 0; r < w; ++r)
      for (int64_t i : o.rank_slice(step, r, w)) ++count[i];
  }
  ASSERT_EQ(static_cast<int64_t>(count.size()), n);
  for (const auto& [i, c] : count) ASSERT_EQ(c, 1) << "sample " << i;
}

TEST(ShardedDataOrder, PureFunctionWhateverTheQueryOrder) {
  data_order a(2, layout({30, 40, 50, 60}, 2), 10), b(2, layout({30, 40, 50, 60}, 2), 10);
  auto later = a.global_batch(40);  // epoch 2
  (void)a.global_batch(1);          // epoch 0: replaces a's cached epoch
  EXPECT_EQ(a.global_batch(40), later);
  EXPECT_EQ(b.global_batch(40), later);
  EXPECT_THROW(data_order(1, layout({}, 1), 4), std::invalid_argument);
  EXPECT_THROW(data_order(1, layout({3, 0}, 1), 4), std::invalid_argument);
  EXPECT_THROW(data_order(1, layout({3}, 0), 4), std::invalid_argument);
}

}  // namespace
}  // namespace dtactor
