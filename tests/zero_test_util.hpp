// What the ZeRO tests share (tests/zero_test.cpp, tests/zero2_test.cpp): the
// parameter sync's settings, buckets, a few steps on every rank, and a
// node per rank.
#pragma once

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

namespace dtactor::zero_test {

using testing::make_states;
using testing::run_ranks;
using testing::tiny_vit_config;

// ZeRO's parameter sync over `pg` (and its segments), the norm from the
// shards with `sharded_norm` (as the rank worker runs every level from 1).
inline zero_sync_settings zero_sync(c10::intrusive_ptr<c10d::ProcessGroup> pg, bool sharded_norm) {
  zero_sync_settings z;
  z.pg = std::move(pg);
  z.sharded_norm = sharded_norm;
  z.timeout = std::chrono::milliseconds(20000);
  z.spin = std::chrono::microseconds(50);
  return z;
}

inline grad_sync_options buckets() {
  grad_sync_options o;
  o.bucket_bytes = 16 * 1024;
  return o;
}

// `steps` data-parallel steps of states[0..world) in one group; with a plan,
// sharded (the plan's ranges already set), with the parameter all-gather.
inline std::vector<std::string> train(std::vector<std::unique_ptr<training_state>>& states, int world, int steps, const shard_plan* plan) {
  return run_ranks(world, [&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> pg) -> std::string {
    auto& s = *states[static_cast<size_t>(rank)];
    grad_sync sync(s.the_task().module()->parameters(), pg, buckets());
    if (plan) sync.set_parameter_sync(zero_sync_over_group(s.optimizer(), *plan, zero_sync(pg, true)));
    for (int i = 0; i < steps; ++i) {
      auto r = s.train_step(step_context::every_step(rank, world, sync));
      if (!r) return r.message();
    }
    return "";
  });
}

inline void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_TRUE(errors[r].empty()) << "rank " << r << ": " << errors[r];
}
#define expect_no_errors(x) \
  do {                      \
    SCOPED_TRACE(#x);       \
    expect_no_errors(x);    \
  } while (0)

// A node per rank.
inline std::vector<std::string> nodes_of(int world) {
  std::vector<std::string> n;
  for (int r = 0; r < world; ++r) n.push_back(std::string(1, static_cast<char>('a' + r)));
  return n;
}

}  // namespace dtactor::zero_test
