#include <gtest/gtest.h>

#include "rank/tune_batch.hpp"

namespace dtactor {
namespace {

TEST(TuneBatch, ParsesSizes) {
  EXPECT_EQ(parse_bytes("1000").value(), 1000);
  EXPECT_EQ(parse_bytes("8G").value(), int64_t{8} << 30);
  EXPECT_EQ(parse_bytes("512MiB").value(), int64_t{512} << 20);
  EXPECT_EQ(parse_bytes("1.5g").value(), int64_t{3} << 29);
  EXPECT_EQ(parse_bytes("2k").value(), 2048);
  for (const char* bad : {"", "lots", "-1G", "0", "8X", "nan"}) {
    auto r = parse_bytes(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_NE(r.message().find("is not a size"), std::string::npos) << r.message();
  }
}

TEST(TuneBatch, RefusesImpossibleBoundsBeforeAnyProbe) {
  tune_batch_options o;
  o.run_dir = "/nonexistent-never-created";
  o.start = 64;
  o.up_to = 8;
  o.max_memory = 1 << 30;
  auto r = run_tune_batch(config(), o);
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("--up-to (8) is below --start (64)"), std::string::npos) << r.message();
}

}  // namespace
}  // namespace dtactor
