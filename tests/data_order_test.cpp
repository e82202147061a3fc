#include "model/data_order.hpp"

#include <gtest/gtest.h>

#include <algorithm>
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

}  // namespace
}  // namespace dtactor
