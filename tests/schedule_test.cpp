#include "model/schedule.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace dtactor {
namespace {

TEST(Schedule, WarmupIsLinear) {
  lr_schedule s{1.0, 0.0, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(4), 0.5);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
}

TEST(Schedule, CosineDecayToMin) {
  lr_schedule s{1.0, 0.1, 10, 110};
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // halfway: min + (peak-min)/2
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(500), 0.1, 1e-12);  // clamped past the end
  for (int64_t t = 10; t < 110; ++t) EXPECT_GE(s.at(t), s.at(t + 1));
}

TEST(Schedule, NoWarmup) {
  lr_schedule s{2.0, 0.0, 0, 100};
  EXPECT_DOUBLE_EQ(s.at(0), 2.0);
  EXPECT_NEAR(s.at(25), 1.0 + std::cos(M_PI * 0.25), 1e-12);
}

}  // namespace
}  // namespace dtactor
