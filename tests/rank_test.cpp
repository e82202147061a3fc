// The rank layer: rank workers as threads of one process meeting at a real
// c10d store (Gloo's own test style): they train a generation together, a
// rank that joins later takes the state from its peer, checkpoints are
// deferred, owed and resumed. The agreement's arithmetic is in
// rank_agreement_test.cpp, the part writer's in part_writer_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "rank/agreement.hpp"
#include "rank/part_writer.hpp"
#include "rank/state_io.hpp"
#include "rank/rank_worker.hpp"
#include "rank/step_policy.hpp"
#include "rank/sync_diloco.hpp"
#include "storage/checkpoint_store.hpp"
#include "net/rendezvous_store.hpp"
#include "net/zmq_bridge.hpp"
#include "test_util.hpp"

using namespace dtactor;

namespace {

// What the workers reported, waited for by event.
struct reports {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<int, pb::rank_status>> statuses;  // (local rank, status)
  std::map<int, int64_t> last_step;                       // local rank -> last reported step
  std::vector<std::pair<int, pb::checkpoint_written>> checkpoints;  // (local rank, report) of each part stored
  std::vector<std::pair<int, std::string>> order;                    // (local rank, "checkpoint N" / "status S") as reported
  // Tests: called on a rank's checkpoint writer thread with each part's
  // report, before the writer counts as done with it (set before start).
  std::function<void(int local, const pb::checkpoint_written&)> while_storing;
  // Tests: called on a rank's training thread after each step's report.
  std::function<void(int local, int64_t step)> after_step;
  rank_work_callbacks for_rank(int local) {
    rank_work_callbacks cb;
    cb.on_checkpoint = [this, local](uint64_t, pb::checkpoint_written w) {
      if (while_storing) while_storing(local, w);
      std::lock_guard<std::mutex> lock(mu);
      order.emplace_back(local, "checkpoint " + std::to_string(w.step()));
      checkpoints.emplace_back(local, std::move(w));
      cv.notify_all();
    };
    cb.on_status = [this, local](uint64_t, pb::rank_status s) {
      std::lock_guard<std::mutex> lock(mu);
      order.emplace_back(local, "status " + pb::rank_status::state_Name(s.status()));
      statuses.emplace_back(local, std::move(s));
      cv.notify_all();
    };
    cb.on_step = [this, local](uint64_t, pb::step_report r) {
      {
        std::lock_guard<std::mutex> lock(mu);
        last_step[local] = r.step();
        cv.notify_all();
      }
      if (after_step) after_step(local, r.step());
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
  // Forgets the statuses `local` reported so far (wait_for then finds a later one).
  void clear_status(int local) {
    std::lock_guard<std::mutex> lock(mu);
    statuses.erase(std::remove_if(statuses.begin(), statuses.end(), [&](const auto& x) { return x.first == local; }), statuses.end());
  }
  bool wait_step(int local, int64_t step) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::minutes(2), [&] { return last_step.count(local) && last_step[local] >= step; });
  }
};

pb::generation_plan plan_of(uint64_t g, const std::vector<int>& locals, int port, const std::string& config_toml, bool drain,
                            const std::string& checkpoints = "") {
  pb::generation_plan p;
  p.set_checkpoint_store(checkpoints);
  p.set_checkpoint_step(-1);
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
// Holds the writer thread in the first part it stores (as a slow store
// would) until let_go(): which step that is depends on when the part
// buffer was ready, so tests ask.
struct held_part {
  std::mutex mu;
  std::condition_variable cv;
  int64_t step = -1;
  bool release = false;
  void hold_first(int64_t s) {
    std::unique_lock<std::mutex> lock(mu);
    if (step >= 0) return;
    step = s;
    cv.notify_all();
    cv.wait_for(lock, std::chrono::minutes(2), [&] { return release; });
  }
  int64_t wait_held() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::minutes(2), [&] { return step >= 0; });
    return step;
  }
  bool holding() {
    std::lock_guard<std::mutex> lock(mu);
    return step >= 0 && !release;
  }
  void let_go() {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
    cv.notify_all();
  }
};

class rank_workers : public ::testing::Test {
 protected:
  void start(int64_t max_steps, const std::vector<std::string>& extra = {}) {
    auto p = pick_free_tcp_port();
    ASSERT_TRUE(p) << p.message();
    port = p.value();
    auto s = rendezvous_store::start(port, std::chrono::seconds(60));
    ASSERT_TRUE(s) << s.message();
    store = std::move(s.value());
    std::vector<std::string> sets = {"train.max_steps=" + std::to_string(max_steps), "train.log_every_steps=1", "cluster.shm_allreduce=false"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    toml = dtactor::testing::tiny_vit_config(sets).to_toml();
    ckpt_dir = ::testing::TempDir() + "/rank-test-ckpt-" + std::to_string(::getpid()) + "-" +
               ::testing::UnitTest::GetInstance()->current_test_info()->name();
    std::filesystem::remove_all(ckpt_dir);
    std::filesystem::create_directories(ckpt_dir);
    a = std::make_unique<rank_worker>(worker_opts(0), seen.for_rank(0));
    b = std::make_unique<rank_worker>(worker_opts(1), seen.for_rank(1));
    // One after the other: both build their model from train.seed through
    // the process-wide generator (separate processes in a real job), and
    // DiLoCo's global parameters are the initial ones, never broadcast.
    pb::generation_plan warm;
    warm.set_config_toml(toml);
    ASSERT_TRUE(a->offer(warm));
    ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
    ASSERT_TRUE(b->offer(warm));
  }
  pb::generation_plan plan(uint64_t g, const std::vector<int>& locals, bool drain) { return plan_of(g, locals, port, toml, drain, ckpt_dir); }
  void join_heals_and_both_stay_identical(const std::vector<std::string>& extra);
  // Every part stored so far, by step (each rank's report of it).
  std::map<int64_t, std::vector<pb::checkpoint_written>> checkpoints_by_step() {
    std::map<int64_t, std::vector<pb::checkpoint_written>> by_step;
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, w] : seen.checkpoints) by_step[w.step()].push_back(w);
    return by_step;
  }
  // " 2x2 5x2(due 4) ...": each step, its parts, the step it fell due at.
  static std::string describe(const std::map<int64_t, std::vector<pb::checkpoint_written>>& by_step) {
    std::string steps;
    for (const auto& [s, ws] : by_step)
      steps += " " + std::to_string(s) + "x" + std::to_string(ws.size()) + (ws[0].due_step() > 0 ? "(due " + std::to_string(ws[0].due_step()) + ")" : "");
    return steps;
  }
  void TearDown() override {
    held.let_go();  // a writer a test held, even after a failed assertion
    a.reset();
    b.reset();
    std::filesystem::remove_all(ckpt_dir);
  }

  int port = 0;
  std::string toml, ckpt_dir;
  std::unique_ptr<rendezvous_store> store;  // outlives the workers (declared first)
  reports seen;
  held_part held;  // a test's held checkpoint write; outlives the workers
  std::unique_ptr<rank_worker> a, b;
};

// The broadcast before the first step (healing while training off; the
// next test has it on).
TEST_F(rank_workers, a_rank_that_joins_later_takes_the_state_from_its_peer_and_both_finish_identical) {
  start(30, {"cluster.heal_while_training=false"});
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));

  // Generation 1: a trains alone.
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  auto ready_a = seen.wait_for(0, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready_a);
  EXPECT_EQ(ready_a->state_source(), pb::rank_status::ORIGIN_FRESH);
  ASSERT_TRUE(seen.wait_step(0, 5));

  // Generation 2 (a join: drain): b comes in at step 0 and takes a's state.
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready_b);
  EXPECT_EQ(ready_b->state_source(), pb::rank_status::ORIGIN_PEER);
  EXPECT_EQ(ready_b->state_root(), 0);
  EXPECT_GT(ready_b->state_bytes(), 0u);
  EXPECT_GT(ready_b->state_transfer_s(), 0.0);
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

// cluster.heal_while_training (the default): b joins holding nothing; both
// train the generation's first step on their own slices while a's state
// goes to b, b's forward waiting for the parameters and its update for the
// rest. Every step's digest is compared from then on: a state that landed
// torn, late or at the wrong step fails the job.
void rank_workers::join_heals_and_both_stay_identical(const std::vector<std::string>& extra) {
  std::vector<std::string> sets{"cluster.digest_every_steps=1"};
  sets.insert(sets.end(), extra.begin(), extra.end());
  start(30, sets);
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  ASSERT_TRUE(seen.wait_step(0, 5));
  seen.clear_status(0);

  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_a = seen.wait_for(0, pb::rank_status::STATE_READY);
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready_a && ready_b);
  EXPECT_EQ(ready_b->state_source(), pb::rank_status::ORIGIN_PEER);
  EXPECT_TRUE(ready_b->healing());
  EXPECT_FALSE(ready_a->healing());
  // a trained on to the boundary where both hold the plan; b was idle.
  EXPECT_GT(ready_a->drain_s(), 0.0);
  EXPECT_GE(ready_a->group_s(), ready_a->drain_s());
  EXPECT_EQ(ready_b->drain_s(), 0.0);
  EXPECT_GT(ready_b->state_bytes(), 0u);
  EXPECT_EQ(ready_b->state_transfer_s(), 0.0);  // still arriving at READY
  EXPECT_EQ(ready_b->step(), ready_a->step());  // the step it heals at: the one a holds
  EXPECT_GE(ready_b->step(), 5);
  EXPECT_LT(ready_b->step(), 30);

  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b) << "a rank failed: a digest differed after the heal, or the state did not land";
  EXPECT_EQ(done_a->step(), 30);
  EXPECT_EQ(done_b->step(), 30);
  EXPECT_EQ(done_a->detail(), done_b->detail());
  std::lock_guard<std::mutex> lock(seen.mu);
  for (const auto& [l, st] : seen.statuses) EXPECT_NE(st.status(), pb::rank_status::STATE_FAILED) << "rank " << l << ": " << st.detail();
}

TEST_F(rank_workers, a_rank_that_joins_heals_while_its_peer_trains_the_first_step_and_both_stay_identical) {
  join_heals_and_both_stay_identical({});
}

// The same in bf16: the state's parameters are the fp32 masters, sent
// first; the receiver's forward rounds them into its compute copies as
// every forward does (Chaos.Bf16ReplacementHealsWhileTrainingBitForBit
// compares the end with a run without the join).
TEST_F(rank_workers, a_rank_that_joins_heals_in_bf16_and_both_stay_identical) { join_heals_and_both_stay_identical({"train.precision=bf16"}); }

// A survivor alone after a loss keeps its reducer's bucket buffers: when a
// replacement joins, its new reducer takes them (nothing to allocate and
// zero while the joining rank waits). Its READY says so.
TEST_F(rank_workers, a_rank_alone_keeps_its_bucket_buffers_for_when_the_world_grows_again) {
  start(40);
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  ASSERT_TRUE(seen.wait_step(0, 3));
  seen.clear_status(0);
  const auto g2 = plan(2, {0}, true);  // b leaves: a trains alone
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto alone = seen.wait_for(0, pb::rank_status::STATE_READY);
  ASSERT_TRUE(alone);
  const int64_t at = alone->step();
  ASSERT_TRUE(seen.wait_step(0, at + 2));
  seen.clear_status(0);
  const auto g3 = plan(3, {0, 1}, true);
  ASSERT_TRUE(a->offer(g3));
  ASSERT_TRUE(b->offer(g3));
  auto ready = seen.wait_for(0, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready);
  EXPECT_NE(ready->detail().find("bucket buffers kept from before"), std::string::npos) << ready->detail();
  EXPECT_GE(ready->step(), at + 2);
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_FINISHED));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_FINISHED));
}

// A rank alone takes a drain plan (the world grows) before its next step:
// the plan arrives while step 5 is being reported (the rank is held there),
// and the rank's READY in the new generation is at step 5, not a step later.
TEST_F(rank_workers, a_rank_alone_takes_a_drain_plan_before_its_next_step) {
  std::mutex held_mu;
  std::condition_variable held_cv;
  bool at_five = false, release = false;
  seen.after_step = [&](int local, int64_t step) {
    if (local != 0 || step != 5) return;
    std::unique_lock<std::mutex> lock(held_mu);
    at_five = true;
    held_cv.notify_all();
    held_cv.wait_for(lock, std::chrono::minutes(2), [&] { return release; });
  };
  start(40);
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  {
    std::unique_lock<std::mutex> lock(held_mu);
    ASSERT_TRUE(held_cv.wait_for(lock, std::chrono::minutes(2), [&] { return at_five; }));
  }
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  {
    std::lock_guard<std::mutex> lock(held_mu);
    release = true;
  }
  held_cv.notify_all();
  std::optional<pb::rank_status> ready;
  {
    std::unique_lock<std::mutex> lock(seen.mu);
    seen.cv.wait_for(lock, std::chrono::minutes(2), [&] {
      int n = 0;
      for (const auto& [l, st] : seen.statuses)
        if (l == 0 && st.status() == pb::rank_status::STATE_READY && ++n == 2) ready = st;
      return ready.has_value();
    });
  }
  ASSERT_TRUE(ready) << "no READY of rank 0 in generation 2";
  EXPECT_EQ(ready->step(), 5) << "the drain plan came during step 5's report";
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  EXPECT_EQ(done_a->detail(), done_b->detail());
}

// A rank that leaves a generation while its buffered checkpoint write is
// still storing does not wait for it: the write reads its own copy. Rank 0,
// alone, is held in storing its first part; a drain plan brings rank 1 in,
// and rank 1 is READY in the new generation while that write is still held.
// Released, the part is reported and both ranks finish identical.
TEST_F(rank_workers, a_generation_switch_does_not_wait_for_a_buffered_checkpoint_write) {
  seen.while_storing = [&](int local, const pb::checkpoint_written& w) {
    if (local == 0) held.hold_first(w.step());
  };
  start(30, {"checkpoint.every_steps=2", "checkpoint.defer_while_writing=true", "checkpoint.direct=false"});
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  const int64_t first = held.wait_held();
  ASSERT_GT(first, 0) << "rank 0 stored no part";
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  const bool still_held = held.holding();
  held.let_go();
  ASSERT_TRUE(ready_b) << "rank 1 never became READY in generation 2";
  EXPECT_TRUE(still_held);
  EXPECT_EQ(ready_b->state_source(), pb::rank_status::ORIGIN_PEER);
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  EXPECT_EQ(done_a->detail(), done_b->detail());
  bool step2_stored = false;
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, w] : seen.checkpoints)
      if (l == 0 && w.step() == first && w.error().empty() && w.parts_size() > 0) step2_stored = true;
  }
  EXPECT_TRUE(step2_stored) << "rank 0's part of step " << first << ", stored after the switch";
}

// checkpoint.direct = auto makes a fresh rank's part buffer after the
// generation's first step: a checkpoint due right at that step would make
// it in its stall, so it is deferred on both ranks (the fresh ranks count
// as writing until then) and taken at a later boundary, saying so.
TEST_F(rank_workers, a_checkpoint_due_right_after_the_first_step_waits_for_the_part_buffer) {
  start(8, {"checkpoint.every_steps=1", "checkpoint.defer_while_writing=true", "checkpoint.direct=auto"});
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  auto by_step = checkpoints_by_step();
  const std::string steps = describe(by_step);
  EXPECT_EQ(by_step.count(1), 0u) << "due at the first step, before the buffer:" << steps;
  ASSERT_FALSE(by_step.empty()) << "no checkpoint at all";
  const auto& first = by_step.begin()->second;
  EXPECT_GT(by_step.begin()->first, 1) << steps;
  EXPECT_EQ(first.size(), 2u) << steps;
  for (const auto& w : first) EXPECT_EQ(w.due_step(), 1) << "the first checkpoint says it fell due at step 1:" << steps;
  EXPECT_EQ(by_step[8].size(), 2u) << "the last step's checkpoint:" << steps;
}

// A checkpoint deferred while a writer is busy and not yet taken when the
// generation ends is still owed in the next one: rank 0, alone, is held in
// storing its first part (step 4, or 5), so the next checkpoint due (8) is
// deferred; a drain plan brings rank 1 in before it was taken. The ranks
// agree on it, and the first checkpoint after step 8 says it fell due at
// 8, on both ranks (without the carry it would be the one due at 12, with
// no due step).
TEST_F(rank_workers, a_checkpoint_still_owed_when_a_generation_ends_is_taken_in_the_next) {
  seen.while_storing = [&](int local, const pb::checkpoint_written& w) {
    if (local == 0) held.hold_first(w.step());
  };
  start(20, {"checkpoint.every_steps=4", "checkpoint.defer_while_writing=true", "checkpoint.direct=false"});
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  const int64_t first = held.wait_held();  // 4 (5 when the buffer was not ready at 4)
  ASSERT_GT(first, 0) << "rank 0 stored no part";
  const int64_t due = (first / 4 + 1) * 4;
  ASSERT_TRUE(seen.wait_step(0, due + 1));  // past that boundary: its checkpoint deferred
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  held.let_go();
  ASSERT_TRUE(ready_b);
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  auto by_step = checkpoints_by_step();
  const std::string steps = describe(by_step);
  EXPECT_EQ(by_step.count(due), 0u) << "deferred while rank 0 still stored step " << first << ":" << steps;
  auto after = by_step.upper_bound(due);
  ASSERT_NE(after, by_step.end()) << steps;
  EXPECT_LT(after->first, 20) << steps;
  EXPECT_EQ(after->second.size(), 2u) << "both ranks' parts:" << steps;
  for (const auto& w : after->second) EXPECT_EQ(w.due_step(), due) << "owed since step " << due << ":" << steps;
}

// DiLoCo: a rank that leaves a generation behind its peer (it was offered
// the next plan first, as when a third rank is lost) catches up on the steps
// its peer took, on its own slices of them, instead of skipping them: the
// job ends with the parameters of the same job uninterrupted (a second pair
// of workers, later generation numbers on the same store).
TEST_F(rank_workers, a_diloco_rank_behind_its_peer_at_a_new_generation_catches_up_and_the_job_ends_as_if_uninterrupted) {
  start(60, {"train.sync=diloco", "train.sync_every=40"});
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  ASSERT_TRUE(seen.wait_step(0, 5));
  // a leaves generation 1 at once; b trains on in its window (no collective
  // until the boundary at 40) and is offered generation 2 later.
  const auto g2 = plan(2, {0, 1}, false);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(seen.wait_step(1, 20));
  ASSERT_TRUE(b->offer(g2));
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  auto said = [&] {
    std::lock_guard<std::mutex> lock(seen.mu);
    std::string out;
    for (const auto& [l, st] : seen.statuses)
      out += std::to_string(l) + ": " + pb::rank_status::state_Name(st.status()) + " step " + std::to_string(st.step()) + " " + st.detail() + "\n";
    return out;
  };
  ASSERT_TRUE(done_a && done_b) << said();
  EXPECT_EQ(done_a->step(), 60);
  EXPECT_EQ(done_a->detail(), done_b->detail());
  // Generation 2's READY statuses: a was behind b there.
  std::vector<int64_t> ready_steps[2];
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, st] : seen.statuses)
      if (st.status() == pb::rank_status::STATE_READY) ready_steps[l].push_back(st.step());
  }
  ASSERT_EQ(ready_steps[0].size(), 2u);
  ASSERT_EQ(ready_steps[1].size(), 2u);
  EXPECT_LT(ready_steps[0][1], 20);
  EXPECT_GE(ready_steps[1][1], 20);

  reports seen2;
  auto a2 = std::make_unique<rank_worker>(worker_opts(0), seen2.for_rank(0));
  auto b2 = std::make_unique<rank_worker>(worker_opts(1), seen2.for_rank(1));
  pb::generation_plan warm;
  warm.set_config_toml(toml);
  ASSERT_TRUE(a2->offer(warm));
  ASSERT_TRUE(seen2.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(b2->offer(warm));
  ASSERT_TRUE(seen2.wait_for(1, pb::rank_status::STATE_IDLE));
  const auto g10 = plan(10, {0, 1}, false);
  ASSERT_TRUE(a2->offer(g10));
  ASSERT_TRUE(b2->offer(g10));
  auto straight = seen2.wait_for(0, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(straight);
  EXPECT_EQ(straight->step(), 60);
  EXPECT_EQ(done_a->detail(), straight->detail());
  a2.reset();
  b2.reset();
}

// checkpoint.defer_while_writing (the default): rank 0's writer is held on its
// first part, at step F (2, or 3 when the buffer made after the first step
// was not ready at 2), as a slow store would, until rank 0 has trained 5
// steps more. The next two checkpoints due (D and D + 2) are deferred on
// both ranks (rank 1's writer is free: they agree through the step's
// control words), training goes on meanwhile, and the first boundary after
// the write ended takes one checkpoint, which says it fell due at D.
TEST_F(rank_workers, a_checkpoint_due_while_a_rank_still_stores_the_previous_one_is_deferred_on_every_rank) {
  seen.while_storing = [&](int local, const pb::checkpoint_written& w) {
    if (local == 0) held.hold_first(w.step());
  };
  start(24, {"checkpoint.every_steps=2", "checkpoint.defer_while_writing=true", "checkpoint.direct=false"});
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  const int64_t first = held.wait_held();
  ASSERT_GT(first, 0) << "rank 0 stored no part";
  const int64_t due = (first / 2 + 1) * 2;  // the next checkpoint due after the held one
  ASSERT_TRUE(seen.wait_step(0, due + 3));
  held.let_go();
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  auto by_step = checkpoints_by_step();
  const std::string steps = describe(by_step);
  EXPECT_EQ(by_step[first].size(), 2u) << steps;
  EXPECT_EQ(by_step.count(due), 0u) << "due while rank 0 still stored step " << first << ":" << steps;
  EXPECT_EQ(by_step.count(due + 2), 0u) << steps;
  int64_t deferred = -1;
  for (const auto& [s, ws] : by_step)
    if (s > due + 2 && s < 24 && ws[0].due_step() == due) deferred = s;
  ASSERT_GT(deferred, due + 2) << "no checkpoint said it fell due at step " << due << ":" << steps;
  for (const auto& w : by_step[deferred]) EXPECT_EQ(w.due_step(), due) << "both ranks' parts of step " << deferred;
  EXPECT_EQ(by_step[deferred].size(), 2u) << steps;
  EXPECT_EQ(by_step[24].size(), 2u) << "the last step's checkpoint:" << steps;
  EXPECT_EQ(by_step[24][0].due_step(), 0) << steps;
}

// A stop with a final checkpoint may reach one rank a moment before the
// other: every rank stops at the same step, and every rank stores its part
// of the final checkpoint (even the one not asked yet) before it reports
// FINISHED. The parts make a checkpoint whose state is the ranks' own, and
// one rank alone resumes from it (another world size).
TEST_F(rank_workers, a_stop_asked_of_one_rank_stops_both_with_every_part_of_a_final_checkpoint_that_one_rank_resumes_from) {
  start(100000);
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  ASSERT_TRUE(seen.wait_step(0, 3));
  b->request_stop(true);  // rank 1 only
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  const int64_t step = done_a->step();
  EXPECT_EQ(step, done_b->step());
  EXPECT_LT(step, 100000);

  // Each rank: its part of step `step`, stored, before its FINISHED.
  std::string meta_bytes;
  std::map<int32_t, std::vector<pb::checkpoint_part>> by_rank;
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (int local : {0, 1}) {
      std::vector<std::string> mine;
      for (const auto& [l, what] : seen.order)
        if (l == local) mine.push_back(what);
      auto fin = std::find(mine.begin(), mine.end(), "status STATE_FINISHED");
      auto ck = std::find(mine.begin(), mine.end(), "checkpoint " + std::to_string(step));
      ASSERT_NE(ck, mine.end()) << "rank " << local << " stored no part of the final checkpoint";
      EXPECT_LT(ck - mine.begin(), fin - mine.begin());
    }
    std::map<int32_t, pb::checkpoint_part> parts;
    for (const auto& [l, w] : seen.checkpoints) {
      if (w.step() != step) continue;
      ASSERT_TRUE(w.error().empty()) << w.error();
      EXPECT_EQ(w.world_size(), 2);
      ASSERT_EQ(w.parts_size(), 1) << "one range per rank without ZeRO";
      parts[w.global_rank()] = w.parts(0);
      if (w.global_rank() == 0) meta_bytes = w.meta();
    }
    ASSERT_EQ(parts.size(), 2u);
    for (auto& [r, p] : parts) by_rank[r] = {p};
  }
  auto meta = plan_manifest(meta_bytes, 1, 2, by_rank);
  ASSERT_TRUE(meta) << meta.message();
  auto store = checkpoint_store::open(ckpt_dir, {});
  ASSERT_TRUE(store) << store.message();
  auto committed = store->commit(meta.value());
  ASSERT_TRUE(committed) << committed.message();

  // One rank, a fresh process's worker, resumes from it: the same state.
  const std::string toml_at = dtactor::testing::tiny_vit_config(
                                  {"train.max_steps=" + std::to_string(step), "train.log_every_steps=1", "cluster.shm_allreduce=false"})
                                  .to_toml();
  reports alone;
  rank_worker c(worker_opts(0), alone.for_rank(0));
  pb::generation_plan warm;
  warm.set_config_toml(toml_at);
  ASSERT_TRUE(c.offer(warm));
  auto p = plan_of(1, {0}, port, toml_at, false, ckpt_dir);
  p.set_checkpoint_step(step);
  ASSERT_TRUE(c.offer(p));
  auto ready = alone.wait_for(0, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready);
  EXPECT_EQ(ready->state_source(), pb::rank_status::ORIGIN_DISK);
  EXPECT_EQ(ready->step(), step);
  auto done = alone.wait_for(0, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->detail(), done_a->detail()) << "the checkpoint holds the ranks' parameters";
}

// Global rank 0 of a generation joins holding nothing and reads the plan's
// checkpoint (step 3) while its peer holds a step it trained since (a held
// at step 6 until the plan is offered). Every rank takes the same state
// source: the reader heals from its peer as a fresh rank does, and both go
// on identical to the end (a digest a step). Taking another source than
// the peer left each waiting in a collective the other never joined.
TEST_F(rank_workers, a_rank_that_read_an_older_checkpoint_than_its_peer_holds_heals_from_the_peer) {
  seen.after_step = [this](int local, int64_t step) {
    if (local == 0 && step == 6) held.hold_first(step);
  };
  start(30, {"checkpoint.every_steps=3", "checkpoint.direct=false", "cluster.digest_every_steps=1"});
  ASSERT_TRUE(seen.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  ASSERT_TRUE(seen.wait_step(0, 6));
  std::string meta_bytes;
  std::map<int32_t, std::vector<pb::checkpoint_part>> parts;
  {
    std::unique_lock<std::mutex> lock(seen.mu);
    seen.cv.wait_for(lock, std::chrono::minutes(2), [&] {
      for (const auto& [l, w] : seen.checkpoints)
        if (w.step() == 3 && w.error().empty()) {
          meta_bytes = w.meta();
          parts[w.global_rank()].assign(w.parts().begin(), w.parts().end());
        }
      return !parts.empty();
    });
  }
  ASSERT_EQ(parts.size(), 1u) << "a's checkpoint at step 3";
  auto meta = plan_manifest(meta_bytes, 1, 1, parts);
  ASSERT_TRUE(meta) << meta.message();
  auto store = checkpoint_store::open(ckpt_dir, {});
  ASSERT_TRUE(store) << store.message();
  ASSERT_TRUE(store->commit(meta.value()));
  seen.clear_status(0);

  auto g2 = plan(2, {1, 0}, true);  // b is global rank 0: it reads the checkpoint
  g2.set_checkpoint_step(3);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  held.let_go();
  auto ready_a = seen.wait_for(0, pb::rank_status::STATE_READY);
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  ASSERT_TRUE(ready_a && ready_b) << "the ranks took different state sources";
  EXPECT_GE(ready_a->step(), 6);
  EXPECT_EQ(ready_b->step(), ready_a->step());
  EXPECT_TRUE(ready_b->healing());
  EXPECT_EQ(ready_b->state_source(), pb::rank_status::ORIGIN_PEER);
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  EXPECT_EQ(done_a->step(), 30);
  EXPECT_EQ(done_a->detail(), done_b->detail());
  std::lock_guard<std::mutex> lock(seen.mu);
  for (const auto& [l, st] : seen.statuses) EXPECT_NE(st.status(), pb::rank_status::STATE_FAILED) << "rank " << l << ": " << st.detail();
}

// A rank read the checkpoint in a generation that ended before it trained
// a step (here: the job's last step; in a cluster, a newer plan cutting it
// short). In the next generation its state is still the checkpoint's: it
// and the rank it sends the state to say the state came from disk, and
// every rank reads its own shards from that checkpoint (train.zero=2),
// although that plan names no checkpoint (a live rank holds the state).
TEST_F(rank_workers, a_state_read_from_disk_and_not_trained_since_is_still_from_disk_in_the_next_generation) {
  constexpr int64_t steps = 6;
  start(steps, {"train.zero=2"});
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  auto trained = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(trained);
  std::string meta_bytes;
  std::map<int32_t, std::vector<pb::checkpoint_part>> parts;
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, w] : seen.checkpoints)
      if (w.step() == steps && w.error().empty()) {
        meta_bytes = w.meta();
        parts[w.global_rank()].assign(w.parts().begin(), w.parts().end());
      }
  }
  ASSERT_EQ(parts.size(), 1u) << "rank 0's final checkpoint";
  auto meta = plan_manifest(meta_bytes, 1, 1, parts);
  ASSERT_TRUE(meta) << meta.message();
  auto store = checkpoint_store::open(ckpt_dir, {});
  ASSERT_TRUE(store) << store.message();
  ASSERT_TRUE(store->commit(meta.value()));

  reports later;
  rank_worker c(worker_opts(0), later.for_rank(0));
  rank_worker d(worker_opts(1), later.for_rank(1));
  pb::generation_plan warm;
  warm.set_config_toml(toml);
  ASSERT_TRUE(c.offer(warm));
  ASSERT_TRUE(later.wait_for(0, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(d.offer(warm));
  ASSERT_TRUE(later.wait_for(1, pb::rank_status::STATE_IDLE));
  auto read = plan(5, {0}, false);
  read.set_checkpoint_step(steps);
  read.set_state_root(0);
  ASSERT_TRUE(c.offer(read));
  auto first = later.wait_for(0, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(first);
  auto next = plan(6, {0, 1}, false);
  next.set_state_root(0);
  next.set_fallback_checkpoint_step(steps);
  ASSERT_TRUE(c.offer(next));
  ASSERT_TRUE(d.offer(next));
  std::vector<pb::rank_status> ready;
  {
    std::unique_lock<std::mutex> lock(later.mu);
    later.cv.wait_for(lock, std::chrono::minutes(2), [&] {
      ready.clear();
      for (const auto& [l, st] : later.statuses)
        if (st.status() == pb::rank_status::STATE_READY) ready.push_back(st);
      return ready.size() == 3;
    });
  }
  ASSERT_EQ(ready.size(), 3u) << "one READY in generation 5, two in 6";
  for (const auto& r : ready) {
    EXPECT_EQ(r.step(), steps);
    EXPECT_EQ(r.state_source(), pb::rank_status::ORIGIN_DISK) << "rank " << r.global_rank();
    EXPECT_EQ(r.optimizer_source(), pb::rank_status::SHARDS_CHECKPOINT) << "rank " << r.global_rank();
  }
  auto done_c = later.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_d = later.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_d);
  EXPECT_EQ(done_c->detail(), done_d->detail());
  EXPECT_EQ(done_d->detail(), trained->detail()) << "the checkpoint holds the trained parameters";
}
