#include "comm/bucket_buffers.hpp"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <memory>
#include <thread>

#include "comm/grad_sync.hpp"
#include "grad_sync_util.hpp"
#include "model/trainer.hpp"
#include "rank_threads.hpp"
#include "test_util.hpp"

namespace dtactor {
namespace {

using namespace grad_sync_testing;

grad_sync_options reducer_options(int64_t bucket_bytes, std::shared_ptr<bucket_buffers> pool) {
  grad_sync_options o;
  o.bucket_bytes = bucket_bytes;
  o.carry_control = true;
  o.recycled = std::move(pool);
  return o;
}

// The bytes of a reducer's buckets over `s`: its gradients and the control words.
int64_t bucket_bytes_of(training_state& s) {
  int64_t n = step_control::words * static_cast<int64_t>(sizeof(float));
  for (auto& p : params_of(s)) n += p.numel() * static_cast<int64_t>(p.element_size());
  return n;
}

// Until every buffer given back is takeable: the group's thread lets go of
// a finished collective's inputs a moment after the wait for it returned.
bool all_takeable(const bucket_buffers& pool) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (pool.takeable_bytes() != pool.bytes())
    if (std::chrono::steady_clock::now() > until) return false;
    else std::this_thread::yield();
  return true;
}

TEST(BucketBuffers, ABufferIsTakenOnlyWhenItFitsAndNothingElseReferencesIt) {
  bucket_buffers pool;
  auto t = torch::zeros({1000});
  auto view = t.narrow(0, 10, 20);  // as a collective still in flight holds its input
  pool.give(std::move(t));
  EXPECT_EQ(pool.bytes(), 4000);
  EXPECT_FALSE(pool.take(1000, torch::kFloat).defined());
  EXPECT_EQ(pool.takeable_bytes(), 0);
  view = torch::Tensor();
  EXPECT_EQ(pool.takeable_bytes(), 4000);
  EXPECT_FALSE(pool.take(999, torch::kFloat).defined());
  EXPECT_FALSE(pool.take(1000, torch::kDouble).defined());
  auto got = pool.take(1000, torch::kFloat);
  ASSERT_TRUE(got.defined());
  EXPECT_EQ(got.numel(), 1000);
  EXPECT_EQ(pool.bytes(), 0);
  pool.give(got.clone());
  pool.clear();
  EXPECT_EQ(pool.bytes(), 0);
}

// One reducer a step, as one a generation: each takes the buffers the one
// before gave back, and the parameters come out as with fresh zeroed
// buffers every time, on every rank.
TEST(BucketBuffers, ReducersThatTakeTheLastOnesBuffersStepAsWithTheirOwn) {
  const int world = 2, steps = 3;
  auto cfg = tiny_vit_config();
  auto recycled_states = make_states(cfg, world), fresh_states = make_states(cfg, world);
  std::vector<std::string> recycled(world), fresh(world);
  auto errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto pool = std::make_shared<bucket_buffers>();
    auto& s = *recycled_states[rank];
    const int64_t want = bucket_bytes_of(s);
    for (int i = 0; i < steps; ++i) {
      {
        grad_sync sync(params_of(s), pg, reducer_options(4 * 1024, pool));
        if (i > 0 && pool->bytes() != 0) return "step " + std::to_string(i) + ": the reducer left " + std::to_string(pool->bytes()) + " bytes";
        if (sync.bucket_count() < 2) return "one bucket";
        auto r = s.train_step(step_context::every_step(rank, world, sync));
        if (!r) return r.message();
      }
      if (pool->bytes() != want) return "step " + std::to_string(i) + ": " + std::to_string(pool->bytes()) + " bytes given back, want " + std::to_string(want);
      if (!all_takeable(*pool)) return "step " + std::to_string(i) + ": buffers still referenced 10 s after the step";
    }
    recycled[rank] = s.params_digest();
    auto& f = *fresh_states[rank];
    for (int i = 0; i < steps; ++i) {
      grad_sync sync(params_of(f), pg, reducer_options(4 * 1024, nullptr));
      auto r = f.train_step(step_context::every_step(rank, world, sync));
      if (!r) return r.message();
    }
    fresh[rank] = f.params_digest();
    return "";
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  EXPECT_EQ(recycled[0], recycled[1]);
  EXPECT_EQ(recycled[0], fresh[0]);
}

// What a warm rank makes before its first plan is exactly what the first
// reducer takes; a reducer cutting its buckets otherwise takes none of it.
TEST(BucketBuffers, AWarmRanksBuffersAreWhatTheFirstReducerTakes) {
  const int world = 2;
  auto states = make_states(tiny_vit_config(), world);
  auto errors = run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[rank];
    auto pool = std::make_shared<bucket_buffers>();
    for (auto& b : bucket_buffers_for(params_of(s), reducer_options(4 * 1024, nullptr))) pool->give(std::move(b));
    if (pool->bytes() != bucket_bytes_of(s)) return "made " + std::to_string(pool->bytes()) + " bytes";
    {
      grad_sync other(params_of(s), pg, reducer_options(64 * 1024, pool));
      if (pool->bytes() != bucket_bytes_of(s)) return "a reducer of other buckets took some";
    }
    pool->clear();
    for (auto& b : bucket_buffers_for(params_of(s), reducer_options(4 * 1024, nullptr))) pool->give(std::move(b));
    grad_sync sync(params_of(s), pg, reducer_options(4 * 1024, pool));
    if (pool->bytes() != 0) return std::to_string(pool->bytes()) + " bytes not taken";
    auto r = s.train_step(step_context::every_step(rank, world, sync));
    return r ? "" : r.message();
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

}  // namespace
}  // namespace dtactor
