// The rank layer: the state agreement's arithmetic, the step cadence, and
// rank workers as threads of one process meeting at a real c10d store
// (Gloo's own test style): they train a generation together, and a rank
// that joins later takes the state from its peer.
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
  void TearDown() override {
    a.reset();
    b.reset();
    std::filesystem::remove_all(ckpt_dir);
  }

  int port = 0;
  std::string toml, ckpt_dir;
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
// alone, is held in storing its step-2 part; a drain plan brings rank 1 in,
// and rank 1 is READY in the new generation while that write is still held.
// Released, the part is reported and both ranks finish identical.
TEST_F(rank_workers, a_generation_switch_does_not_wait_for_a_buffered_checkpoint_write) {
  std::mutex held_mu;
  std::condition_variable held_cv;
  bool holding = false, release = false;
  seen.while_storing = [&](int local, const pb::checkpoint_written& w) {
    if (local != 0 || w.step() != 2) return;
    std::unique_lock<std::mutex> lock(held_mu);
    holding = true;
    held_cv.notify_all();
    held_cv.wait_for(lock, std::chrono::minutes(2), [&] { return release; });
  };
  auto let_go = [&] {
    std::lock_guard<std::mutex> lock(held_mu);
    release = true;
    held_cv.notify_all();
  };
  start(30, {"checkpoint.every_steps=2", "checkpoint.defer_while_writing=true", "checkpoint.direct=false"});
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  {
    std::unique_lock<std::mutex> lock(held_mu);
    ASSERT_TRUE(held_cv.wait_for(lock, std::chrono::minutes(2), [&] { return holding; }));
  }
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  bool still_held = false;
  {
    std::lock_guard<std::mutex> lock(held_mu);
    still_held = !release;
  }
  let_go();
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
      if (l == 0 && w.step() == 2 && w.error().empty() && w.parts_size() > 0) step2_stored = true;
  }
  EXPECT_TRUE(step2_stored) << "rank 0's step-2 part, stored after the switch";
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
  std::map<int64_t, std::vector<pb::checkpoint_written>> by_step;
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, w] : seen.checkpoints) by_step[w.step()].push_back(w);
  }
  std::string steps;
  for (const auto& [s, ws] : by_step) steps += " " + std::to_string(s) + (ws[0].due_step() > 0 ? "(due " + std::to_string(ws[0].due_step()) + ")" : "");
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
// storing its step-4 part, so the checkpoint due at 8 is deferred; a drain
// plan brings rank 1 in before it was taken. The ranks agree on it, and the
// first checkpoint after step 8 says it fell due at 8, on both ranks
// (without the carry it would be the one due at 12, with no due step).
TEST_F(rank_workers, a_checkpoint_still_owed_when_a_generation_ends_is_taken_in_the_next) {
  std::mutex held_mu;
  std::condition_variable held_cv;
  bool release = false;
  seen.while_storing = [&](int local, const pb::checkpoint_written& w) {
    if (local != 0 || w.step() != 4) return;
    std::unique_lock<std::mutex> lock(held_mu);
    held_cv.wait_for(lock, std::chrono::minutes(2), [&] { return release; });
  };
  start(16, {"checkpoint.every_steps=4", "checkpoint.defer_while_writing=true", "checkpoint.direct=false"});
  ASSERT_TRUE(seen.wait_for(1, pb::rank_status::STATE_IDLE));
  ASSERT_TRUE(a->offer(plan(1, {0}, false)));
  ASSERT_TRUE(seen.wait_step(0, 9));  // past step 8's boundary, its checkpoint deferred
  const auto g2 = plan(2, {0, 1}, true);
  ASSERT_TRUE(a->offer(g2));
  ASSERT_TRUE(b->offer(g2));
  auto ready_b = seen.wait_for(1, pb::rank_status::STATE_READY);
  {
    std::lock_guard<std::mutex> lock(held_mu);
    release = true;
  }
  held_cv.notify_all();
  ASSERT_TRUE(ready_b);
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  std::map<int64_t, std::vector<pb::checkpoint_written>> by_step;
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, w] : seen.checkpoints) by_step[w.step()].push_back(w);
  }
  std::string steps;
  for (const auto& [s, ws] : by_step) steps += " " + std::to_string(s) + "x" + std::to_string(ws.size()) + (ws[0].due_step() > 0 ? "(due " + std::to_string(ws[0].due_step()) + ")" : "");
  EXPECT_EQ(by_step.count(8), 0u) << "deferred while rank 0 still stored step 4:" << steps;
  auto after = by_step.upper_bound(8);
  ASSERT_NE(after, by_step.end()) << steps;
  EXPECT_LT(after->first, 16) << steps;
  EXPECT_EQ(after->second.size(), 2u) << "both ranks' parts:" << steps;
  for (const auto& w : after->second) EXPECT_EQ(w.due_step(), 8) << "owed since step 8:" << steps;
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

// checkpoint.defer_while_writing (the default): rank 0's writer is held on its step-2
// part (as a slow store would) until rank 0 has trained step 7. The
// checkpoints due at steps 4 and 6 are deferred on both ranks (rank 1's
// writer is free: they agree through the step's control words), training
// goes on meanwhile, and the first boundary after the write ended takes
// one checkpoint, which says it fell due at step 4.
TEST_F(rank_workers, a_checkpoint_due_while_a_rank_still_stores_the_previous_one_is_deferred_on_every_rank) {
  std::mutex held_mu;
  std::condition_variable held_cv;
  bool release = false;
  seen.while_storing = [&](int local, const pb::checkpoint_written& w) {
    if (local != 0 || w.step() != 2) return;
    std::unique_lock<std::mutex> lock(held_mu);
    held_cv.wait_for(lock, std::chrono::minutes(2), [&] { return release; });
  };
  start(20, {"checkpoint.every_steps=2", "checkpoint.defer_while_writing=true"});
  const auto g1 = plan(1, {0, 1}, false);
  ASSERT_TRUE(a->offer(g1));
  ASSERT_TRUE(b->offer(g1));
  ASSERT_TRUE(seen.wait_step(0, 7));
  {
    std::lock_guard<std::mutex> lock(held_mu);
    release = true;
  }
  held_cv.notify_all();
  auto done_a = seen.wait_for(0, pb::rank_status::STATE_FINISHED);
  auto done_b = seen.wait_for(1, pb::rank_status::STATE_FINISHED);
  ASSERT_TRUE(done_a && done_b);
  std::map<int64_t, std::vector<pb::checkpoint_written>> by_step;
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    for (const auto& [l, w] : seen.checkpoints) by_step[w.step()].push_back(w);
  }
  std::string steps;
  for (const auto& [s, ws] : by_step) steps += " " + std::to_string(s) + (ws[0].due_step() > 0 ? "(due " + std::to_string(ws[0].due_step()) + ")" : "");
  EXPECT_EQ(by_step[2].size(), 2u) << steps;
  EXPECT_EQ(by_step.count(4), 0u) << "due while rank 0 still stored step 2:" << steps;
  EXPECT_EQ(by_step.count(6), 0u) << steps;
  int64_t deferred = -1;
  for (const auto& [s, ws] : by_step)
    if (s > 7 && s < 20 && ws[0].due_step() == 4) deferred = s;
  ASSERT_GT(deferred, 7) << "no checkpoint said it fell due at step 4:" << steps;
  for (const auto& w : by_step[deferred]) EXPECT_EQ(w.due_step(), 4) << "both ranks' parts of step " << deferred;
  EXPECT_EQ(by_step[deferred].size(), 2u) << steps;
  EXPECT_EQ(by_step[20].size(), 2u) << "the last step's checkpoint:" << steps;
  EXPECT_EQ(by_step[20][0].due_step(), 0) << steps;
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

// The part writer alone: rank 1 of 2 stores exactly its byte range of the
// stream, in the background, and says so; a store it cannot open is the
// part's error (the committer then reports the checkpoint as not saved).
TEST(part_writer, stores_its_byte_range_and_reports_a_store_it_cannot_use) {
  state_layout l;
  auto a = torch::arange(0, 3000, torch::kFloat);
  auto b = torch::arange(0, 500, torch::kLong);
  l.entries.push_back({"a", a, 0, 12000});
  l.entries.push_back({"b", b, 12000, 4000});
  l.bytes = 16000;
  std::string stream(16000, '\0');
  copy_range(l, 0, 16000, stream.data());
  EXPECT_EQ(0, std::memcmp(stream.data(), a.data_ptr(), 12000));
  EXPECT_EQ(0, std::memcmp(stream.data() + 12000, b.data_ptr(), 4000));

  const std::string dir = ::testing::TempDir() + "/part-writer-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<pb::checkpoint_written> got;
  {
    part_writer w([&](uint64_t, pb::checkpoint_written r) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(std::move(r));
      cv.notify_all();
    });
    w.prepare(8192);
    part_writer::job j;
    j.step = 7;
    j.generation = 3;
    j.rank = 1;
    j.world = 2;
    j.node_id = "n";
    j.store = dir;
    w.submit(l, j);
    j.store = "/proc/dtactor-cannot-be-here";
    w.submit(l, j);
    w.wait_idle();
  }
  ASSERT_EQ(got.size(), 2u);
  ASSERT_TRUE(got[0].error().empty()) << got[0].error();
  const auto [from, to] = part_range(16000, 1, 2);
  ASSERT_EQ(got[0].parts_size(), 1);
  EXPECT_EQ(got[0].parts(0).name(), "ckpt-000000007.g3.r1-of-2.part");
  EXPECT_EQ(got[0].parts(0).offset(), from);
  EXPECT_EQ(got[0].parts(0).size(), to - from);
  EXPECT_EQ(got[0].parts(0).node_id(), "n");
  std::ifstream f(dir + "/ckpt-000000007.g3.r1-of-2.part", std::ios::binary);
  std::string stored((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_EQ(stored, stream.substr(from, to - from));
  EXPECT_EQ(got[1].parts_size(), 0);
  EXPECT_NE(got[1].error().find("checkpoint store: directory '/proc/dtactor-cannot-be-here' is not writable"), std::string::npos) << got[1].error();
  std::filesystem::remove_all(dir);
}

// checkpoint.keep_buffer: kept, the part's host buffer stays between
// checkpoints; not kept, it is freed once a part is stored, and the next
// checkpoint allocates it again and stores the same bytes.
TEST(part_writer, a_buffer_not_kept_is_freed_after_each_write_and_made_again) {
  state_layout l;
  auto a = torch::arange(0, 3000, torch::kFloat);
  l.entries.push_back({"a", a, 0, 12000});
  l.bytes = 12000;
  std::string stream(12000, '\0');
  copy_range(l, 0, 12000, stream.data());
  const std::string dir = ::testing::TempDir() + "/part-writer-keep-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  for (bool keep : {true, false}) {
    std::vector<pb::checkpoint_written> got;
    std::mutex mu;
    part_writer w(
        [&](uint64_t, pb::checkpoint_written r) {
          std::lock_guard<std::mutex> lock(mu);
          got.push_back(std::move(r));
        },
        keep);
    for (int64_t step : {4, 8}) {
      part_writer::job j;
      j.step = step;
      j.store = dir;
      w.submit(l, j);
      w.wait_idle();
      EXPECT_EQ(w.buffer_bytes(), keep ? 12000u : 0u) << "keep " << keep << " step " << step;
    }
    ASSERT_EQ(got.size(), 2u);
    for (const auto& r : got) {
      ASSERT_TRUE(r.error().empty()) << r.error();
      ASSERT_EQ(r.parts_size(), 1);
      std::ifstream f(dir + "/" + r.parts(0).name(), std::ios::binary);
      std::string stored((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      EXPECT_EQ(stored, stream);
    }
    std::filesystem::remove_all(dir);
  }
}

// checkpoint.direct: no part-sized buffer; the writer reads the state
// itself a piece at a time (a 12 MB parameter: two pieces and a half) while
// the training thread goes on until fence(). What a forward may change (a
// module buffer) is cloned at submit, so changing it right after submit
// returns changes nothing stored; the parameter is read live, and once
// fence() returns the write is reported and the parameter may change. The
// parts and their checksums are the buffered writer's.
TEST(part_writer, direct_reads_the_state_until_fence_and_clones_what_a_forward_may_change) {
  state_layout l;
  auto a = torch::arange(0, 3 << 20, torch::kFloat);
  auto b = torch::arange(0, 1000, torch::kLong);
  const uint64_t abytes = uint64_t{3} << 22;
  l.entries.push_back({"model/a", a, 0, abytes});
  l.entries.push_back({"buffer/b", b, abytes, 8000});
  l.bytes = abytes + 8000;
  std::string stream(l.bytes, '\0');
  copy_range(l, 0, l.bytes, stream.data());
  const std::string dir = ::testing::TempDir() + "/part-writer-direct-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  // Two ranges (a ZeRO rank's): most of `a`, and the end of `a` with `b`.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {{4096, abytes - 4000}, {abytes - 1000, l.bytes}};
  std::map<bool, pb::checkpoint_written> got;
  for (bool direct : {false, true}) {
    std::mutex mu;
    part_writer w(
        [&](uint64_t, pb::checkpoint_written r) {
          std::lock_guard<std::mutex> lock(mu);
          got[direct] = std::move(r);
        },
        true);
    part_writer::job j;
    j.step = direct ? 2 : 1;
    j.store = dir;
    j.ranges = ranges;
    w.submit(l, j, direct);
    if (direct) {
      torch::NoGradGuard ng;
      b.fill_(-1);  // a buffer, after submit: cloned, so not stored
      w.fence();
      {
        std::lock_guard<std::mutex> lock(mu);
        ASSERT_EQ(got.count(true), 1u) << "fence returned before the write was reported";
      }
      EXPECT_EQ(w.buffer_bytes(), part_writer::direct_piece_bytes);
      EXPECT_LT(w.buffer_bytes(), ranges[0].second - ranges[0].first);
      a.fill_(-1);  // after fence: must not reach the stored parts
      EXPECT_EQ(w.fence(), 0.0) << "nothing in flight";
    }
    w.wait_idle();
    EXPECT_EQ(got.at(direct).direct(), direct);
  }
  for (bool direct : {false, true}) {
    const auto& r = got.at(direct);
    ASSERT_TRUE(r.error().empty()) << r.error();
    ASSERT_EQ(r.parts_size(), 2);
    for (int k = 0; k < 2; ++k) {
      const auto [x, y] = ranges[static_cast<size_t>(k)];
      EXPECT_EQ(r.parts(k).offset(), x);
      EXPECT_EQ(r.parts(k).size(), y - x);
      EXPECT_EQ(r.parts(k).xxh3(), got.at(false).parts(k).xxh3()) << "part " << k;
      std::ifstream f(dir + "/" + r.parts(k).name(), std::ios::binary);
      std::string stored((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
      EXPECT_TRUE(stored == stream.substr(x, y - x)) << (direct ? "direct" : "buffered") << " part " << k;
    }
  }
  std::filesystem::remove_all(dir);
}

// checkpoint.direct = auto: a part buffer per rank of the host, each rank's
// step headroom with it, and a margin (512 MiB, or 5% of the memory when
// more) must fit in what the host still has; unknown memory keeps the
// buffer. What this machine reports is read, and is sane.
TEST(part_writer, auto_takes_the_buffer_only_where_every_ranks_buffer_and_step_fit) {
  const int64_t gib = int64_t{1} << 30;
  memory_room r;
  r.total = 24 * gib;
  r.available = 6 * gib;
  r.step_headroom = gib / 2;
  EXPECT_TRUE(part_buffer_fits(uint64_t(gib), 2, r)) << "2 x (1 + 0.5) GiB + 1.2 GiB margin <= 6 GiB";
  EXPECT_FALSE(part_buffer_fits(uint64_t(gib), 4, r)) << "4 x 1.5 GiB leaves no margin";
  EXPECT_FALSE(part_buffer_fits(uint64_t(3 * gib), 1, memory_room{4 * gib, 24 * gib, gib / 2})) << "3.5 GiB leaves 0.5 GiB, under 5% of 24";
  EXPECT_TRUE(part_buffer_fits(uint64_t(3 * gib), 1, memory_room{4 * gib, 4 * gib, 0})) << "the margin is 512 MiB on a 4 GiB host";
  EXPECT_TRUE(part_buffer_fits(uint64_t(100) * gib, 8, memory_room{-1, 0, 0})) << "unknown: the buffered default";
  EXPECT_FALSE(part_buffer_fits(0, 1, memory_room{100 << 20, gib, 0})) << "below the margin already";
  {
    // A peak this process reached and left (mmapped, so returned at once):
    // what its next step would take again.
    std::vector<char> peak(size_t(64) << 20, 1);
    EXPECT_EQ(peak[peak.size() / 2], 1);
  }
  const memory_room here = read_memory_room();
  EXPECT_GT(here.available, 0);
  EXPECT_GT(here.total, 0);
  EXPECT_LE(here.available, here.total);
  EXPECT_GE(here.step_headroom, int64_t(48) << 20) << "VmHWM - VmRSS after a 64 MiB peak";
}

// What checkpoint.direct reads live (it changes only after the before-update
// hook) and what it clones at submit.
TEST(part_writer, only_parameters_moments_and_outer_state_are_read_live) {
  for (const char* live : {"model/fc.weight", "optim/exp_avg.0", "optim/exp_avg_sq.1", "outer/global.0", "outer/momentum.2", "workers/3/model/fc.bias",
                           "workers/12/optim/exp_avg.0"})
    EXPECT_TRUE(stable_until_update(live)) << live;
  for (const char* cloned : {"buffer/bn.running_mean", "optim/steps", "train/rng", "outer/anchor", "outer/fragment_anchors", "workers/2/buffer/bn.running_var",
                             "workers/", "modelx/a", ""})
    EXPECT_FALSE(stable_until_update(cloned)) << cloned;
}

// ZeRO: a rank that owns scattered ranges of the stream stores each as a
// part of its own (the first under the usual name, the k-th with ".<k>"),
// all in one report, in order, each with its own checksum; ranges that are
// not ascending and disjoint are refused, not stored.
TEST(part_writer, stores_several_ranges_as_parts_of_their_own) {
  state_layout l;
  auto a = torch::arange(0, 3000, torch::kFloat);
  auto b = torch::arange(0, 500, torch::kLong);
  l.entries.push_back({"a", a, 0, 12000});
  l.entries.push_back({"b", b, 12000, 4000});
  l.bytes = 16000;
  std::string stream(16000, '\0');
  copy_range(l, 0, 16000, stream.data());

  const std::string dir = ::testing::TempDir() + "/part-writer-ranges-" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::mutex mu;
  std::vector<pb::checkpoint_written> got;
  const std::vector<std::pair<uint64_t, uint64_t>> ranges{{100, 4196}, {11000, 14000}};  // the second spans both tensors
  {
    part_writer w([&](uint64_t, pb::checkpoint_written r) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(std::move(r));
    });
    part_writer::job j;
    j.step = 1200;
    j.generation = 7;
    j.rank = 0;
    j.world = 2;
    j.node_id = "n";
    j.store = dir;
    j.ranges = ranges;
    w.submit(l, j);
    j.step = 1201;
    j.ranges = {{0, 100}, {50, 200}};  // overlapping
    w.submit(l, j);
    w.wait_idle();
  }
  ASSERT_EQ(got.size(), 2u);
  ASSERT_TRUE(got[0].error().empty()) << got[0].error();
  EXPECT_EQ(got[0].step(), 1200);
  ASSERT_EQ(got[0].parts_size(), 2);
  const std::vector<std::string> names{"ckpt-000001200.g7.r0-of-2.part", "ckpt-000001200.g7.r0-of-2.1.part"};
  for (int k = 0; k < 2; ++k) {
    const auto& p = got[0].parts(k);
    const auto [from, to] = ranges[static_cast<size_t>(k)];
    EXPECT_EQ(p.name(), names[static_cast<size_t>(k)]);
    EXPECT_EQ(p.name(), part_name(1200, 7, 0, 2, k));
    EXPECT_EQ(p.offset(), from);
    EXPECT_EQ(p.size(), to - from);
    EXPECT_EQ(p.rank(), 0);
    EXPECT_EQ(p.node_id(), "n");
    std::ifstream f(dir + "/" + p.name(), std::ios::binary);
    std::string stored((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_EQ(stored, stream.substr(from, to - from)) << p.name();
  }
  EXPECT_NE(got[0].parts(0).xxh3(), got[0].parts(1).xxh3());
  EXPECT_EQ(got[1].parts_size(), 0);
  EXPECT_EQ(got[1].error(), "checkpoint range [50, 200) is not ascending, disjoint and inside the 16000-byte state");
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + part_name(1201, 7, 0, 2))) << "nothing stored";
  std::filesystem::remove_all(dir);
}
