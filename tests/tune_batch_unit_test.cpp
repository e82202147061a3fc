#include <gtest/gtest.h>

#include <torch/torch.h>

#include "model/torch_error.hpp"
#include "model/trainer.hpp"
#include "app/tune_batch.hpp"
#include "test_util.hpp"

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

// Out of memory is a kind of error, told apart where LibTorch's exceptions
// are caught, not by matching text further up.
TEST(TuneBatch, OutOfMemoryIsATypedError) {
  auto caught = [](auto&& f) {
    try {
      f();
    } catch (...) {
      return current_torch_error();
    }
    return make_error("nothing thrown");
  };
  // The CPU allocator's own failure: more bytes than any machine has.
  const auto cpu = caught([] { (void)torch::empty({int64_t{1} << 60}, torch::kFloat); });
  EXPECT_EQ(cpu.code, errc::out_of_memory) << cpu.message;
  EXPECT_EQ(cpu.message.find('\n'), std::string::npos) << cpu.message;
  EXPECT_EQ(caught([] { throw std::bad_alloc(); }).code, errc::out_of_memory);
  // Any other LibTorch error is not.
  const auto shape = caught([] { (void)torch::mm(torch::ones({2, 3}), torch::ones({2, 3})); });
  EXPECT_EQ(shape.code, errc::unspecified);
  EXPECT_FALSE(shape.message.empty());
  EXPECT_EQ(caught([] { throw 42; }).code, errc::unspecified);
}

// A batch the training set cannot fill says so as a kind, which tune-batch
// turns into "too large for the data" (not a failure).
TEST(TuneBatch, ABatchLargerThanTheDataIsATypedError) {
  auto r = training_state::create(testing::tiny_vit_config({"train.global_batch_size=100000000"}));
  ASSERT_FALSE(r);
  EXPECT_EQ(r.code(), errc::batch_exceeds_data) << r.message();
}

// A probe takes the step a world-1 job trains (training_state::train_step
// through a reducer without a group), and with DiLoCo the outer step at its
// boundaries too (max_steps = 3, sync_every = 2: at steps 2 and 3).
TEST(TuneBatch, AProbeTakesTheJobsStepWithDiLoCosOuterStep) {
  for (const char* sync : {"train.sync=every_step", "train.sync=diloco"}) {
    ::testing::internal::CaptureStdout();
    const int rc = run_batch_probe(testing::tiny_vit_config({sync, "train.sync_every=2"}), 8, 3);
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(rc, 0) << sync;
    EXPECT_NE(out.find("\"micro_batch\":8"), std::string::npos) << sync << ": " << out;
    EXPECT_NE(out.find("\"samples_per_s\""), std::string::npos) << sync << ": " << out;
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
