// The rank layer: the state agreement's arithmetic, the step cadence, and
// rank workers as threads of one process meeting at a real c10d store
// (Gloo's own test style): they train a generation together, and a rank
// that joins later takes the state from its peer.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "rank/agreement.hpp"
#include "rank/rank_worker.hpp"
#include "rank/step_policy.hpp"
#include "runtime/rendezvous_store.hpp"
#include "runtime/zmq_bridge.hpp"
#include "test_util.hpp"

using namespace dtactor;

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

namespace {

// What the workers reported, waited for by event.
struct reports {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<int, pb::rank_status>> statuses;  // (local rank, status)
  std::map<int, int64_t> last_step;                       // local rank -> last reported step
  std::vector<std::pair<int, int64_t>> checkpoints;       // (local rank, step) of each checkpoint sent
  rank_work_callbacks for_rank(int local) {
    rank_work_callbacks cb;
    cb.on_checkpoint = [this, local](uint64_t, pb::checkpoint_data d) {
      std::lock_guard<std::mutex> lock(mu);
      checkpoints.emplace_back(local, d.step());
      cv.notify_all();
    };
    cb.on_status = [this, local](uint64_t, pb::rank_status s) {
      std::lock_guard<std::mutex> lock(mu);
      statuses.emplace_back(local, std::move(s));
      cv.notify_all();
    };
    cb.on_step = [this, local](uint64_t, pb::step_report r) {
      std::lock_guard<std::mutex> lock(mu);
      last_step[local] = r.step();
      cv.notify_all();
    };
    return cb;
  }
  // The first status of `local` in `state` (waits up to two minutes: a
  // loaded machine is slow, not wrong).
  std::optional<pb::rank_status> wait_for(int local, pb::rank_status::state state) {
    std::unique_lock<std::mutex> lock(mu);
    std::optional<pb::rank_status> found;
    cv.wait_for(lock, std::chrono::minutes(2), [&] {
      for (const auto& [l, s] : statuses)
        if (l == local && s.status() == state) {
          found = s;
          return true;
        }
      return false;
    });
    return found;
  }
  bool wait_step(int local, int64_t step) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::minutes(2), [&] { return last_step.count(local) && last_step[local] >= step; });
  }
};

pb::generation_plan plan_of(uint64_t g, const std::vector<int>& locals, int port, const std::string& config_toml, bool drain) {
  pb::generation_plan p;
  p.set_generation(g);
  p.set_world_size(static_cast<int32_t>(locals.size()));
  p.set_store_host("127.0.0.1");
  p.set_store_port(port);
  p.set_state_root(-1);
  p.set_drain(drain);
  p.set_config_toml(config_toml);
  for (size_t i = 0; i < locals.size(); ++i) {
    auto* a = p.add_ranks();
    a->set_node_id("n");
    a->set_local_rank(locals[i]);
    a->set_global_rank(static_cast<int32_t>(i));
  }
  return p;
}

rank_worker_options worker_opts(int local) {
  rank_worker_options o;
  o.node_id = "n";
  o.local_rank = local;
  o.local_world = 2;
  o.threads = 1;
  o.advertise_addr = "127.0.0.1";
  return o;
}

}  // namespace

// Two rank workers of node "n" as threads, meeting at a real c10d store in
// this process, warmed up with a tiny ViT of `max_steps`.
class rank_workers : public ::testing::Test {
 protected:
  void start(int64_t max_steps) {
    auto p = pick_free_tcp_port();
    ASSERT_TRUE(p) << p.message();
    port = p.value();
    auto s = rendezvous_store::start(port, std::chrono::seconds(60));
    ASSERT_TRUE(s) << s.message();
    store = std::move(s.value());
    toml = dtactor::testing::tiny_vit_config(
               {"train.max_steps=" + std::to_string(max_steps), "train.log_every_steps=1", "cluster.shm_allreduce=false"})
               .to_toml();
    a = std::make_unique<rank_worker>(worker_opts(0), seen.for_rank(0));
    b = std::make_unique<rank_worker>(worker_opts(1), seen.for_rank(1));
    pb::generation_plan warm;
    warm.set_config_toml(toml);
    ASSERT_TRUE(a->offer(warm));
    ASSERT_TRUE(b->offer(warm));
  }
  pb::generation_plan plan(uint64_t g, const std::vector<int>& locals, bool drain) { return plan_of(g, locals, port, toml, drain); }

  int port = 0;
  std::string toml;
  std::unique_ptr<rendezvous_store> store;  // outlives the workers (declared first)
  reports seen;
  std::unique_ptr<rank_worker> a, b;
};

TEST_F(rank_workers, a_rank_that_joins_later_takes_the_state_from_its_peer_and_both_finish_identical) {
  start(30);
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));

  // Generation 1: a trains alone.
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  auto ready_a = seen.wait_for(0, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready_a);
  EXPECT_EQ(ready_a->state_source(), "fresh");
  ASSERT_TRUE(seen.wait_step(0, 5));

  // Generation 2 (a join: drain): b comes in at step 0 and takes a's state.
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready_b);
  EXPECT_EQ(ready_b->state_source(), "peer");
  EXPECT_EQ(ready_b->state_root(), 0);
  EXPECT_GE(ready_b->step(), 5);
  EXPECT_LT(ready_b->step(), 30);

  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  EXPECT_EQ(done_a->step(), 30);
  EXPECT_EQ(done_b->step(), 30);
  EXPECT_EQ(done_a->detail(), done_b->detail());  // the parameters' digest
  EXPECT_FALSE(done_a->detail().empty());
}

// A stop with a final checkpoint may reach one rank a moment before the
// other: every rank stops at the same step, and rank 0 writes the final
// checkpoint even though only its peer was asked for one so far.
TEST_F(rank_workers, a_stop_asked_of_one_rank_stops_both_at_one_step_with_rank_0s_final_checkpoint) {
  start(100000);
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  ASSERT_TRUE(seen.wait_step(0, 3));
  b->request_stop(true);  // rank 1 only
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  EXPECT_EQ(done_a->step(), done_b->step());
  EXPECT_LT(done_a->step(), 100000);
  std::lock_guard<std::mutex> lock(seen.mu);
  ASSERT_FALSE(seen.checkpoints.empty());
  EXPECT_EQ(seen.checkpoints.back(), std::make_pair(0, done_a->step()));
}
