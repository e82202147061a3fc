// Goodput (monitoring/goodput.hpp) over hand-written journals: each bucket
// to the second.
#include "monitoring/goodput.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace dtactor {
namespace {

ev::step_completed step(int64_t n, uint64_t gen, double step_s) {
  ev::step_completed s;
  s.step = n;
  s.generation = gen;
  s.world_size = 2;
  s.step_s = step_s;
  return s;
}

ev::generation_started plan(uint64_t gen, int64_t start_step) {
  ev::generation_started g;
  g.generation = gen;
  g.world_size = 2;
  g.start_step = start_step;
  return g;
}

// A start, steps (one line per 4 steps), a checkpoint stall, an
// evaluation, a node lost, a wait for the floor, a recovery, the end.
goodput_book a_job_with_everything() {
  goodput_book b;
  b.add(1000, ev::coordinator_started{});
  b.add(1010, plan(1, 0));
  b.add(1012, step(1, 1, 1.0));  // productive 1; start 12 - 1 = 11
  b.add(1020, step(5, 1, 2.0));  // 4 steps of 2 s
  ev::checkpoint_saved c;
  c.stall_s = 0.5;
  b.add(1021, c);
  ev::eval_done e;
  e.duration_s = 1.5;
  b.add(1025, e);
  b.add(1030, step(9, 1, 1.0));  // 4 steps of 1 s
  e.duration_s = 1;
  b.add(1031, e);  // the detection runs from here
  b.add(1033, ev::node_lost{});
  b.add(1034, ev::job_waiting{});
  b.add(1040, plan(2, 9));  // waited 6; recovery 9 - 6 = 3
  ev::recovery_done r;
  r.generation = 2;
  r.duration_s = 7;
  b.add(1047, r);
  b.add(1047, step(10, 2, 1.5));  // recovery + 7 - 1.5
  b.add(1050, ev::job_finished{});
  return b;
}

TEST(goodput, every_bucket_of_a_job_with_a_recovery) {
  const auto g = a_job_with_everything().figures();
  EXPECT_DOUBLE_EQ(g.wall_s, 50);
  EXPECT_DOUBLE_EQ(g.productive_s, 1 + 8 + 4 + 1.5);
  EXPECT_DOUBLE_EQ(g.start_s, 11);
  EXPECT_DOUBLE_EQ(g.recovery_s, 3 + 5.5);
  EXPECT_DOUBLE_EQ(g.waiting_s, 6);
  EXPECT_DOUBLE_EQ(g.checkpoint_s, 0.5);
  EXPECT_DOUBLE_EQ(g.eval_s, 1.5 + 1);
  EXPECT_DOUBLE_EQ(g.other_s, 50 - 14.5 - 11 - 8.5 - 6 - 0.5 - 2.5);
  EXPECT_DOUBLE_EQ(g.ratio, 14.5 / 50);
}

TEST(goodput, the_wall_moves_on_and_an_open_wait_counts_up_to_now) {
  goodput_book b;
  b.add(100, ev::coordinator_started{});
  b.add(101, plan(1, 0));
  b.add(103, step(1, 1, 1.0));
  b.add(104, ev::job_waiting{});
  const auto g = b.figures(110);
  EXPECT_DOUBLE_EQ(g.wall_s, 10);
  EXPECT_DOUBLE_EQ(g.waiting_s, 6);
  EXPECT_DOUBLE_EQ(g.start_s, 2);
  EXPECT_DOUBLE_EQ(g.ratio, 0.1);
  EXPECT_DOUBLE_EQ(b.figures().wall_s, 4);  // as of the latest event
}

// Two plans before the new generation's first step (a second loss during a
// recovery): the time between them is counted once.
TEST(goodput, a_recovery_that_failed_again_is_counted_once) {
  goodput_book b;
  b.add(0.5, ev::coordinator_started{});
  b.add(1, plan(1, 0));
  b.add(2, step(1, 1, 1.0));  // start 0.5
  b.add(5, plan(2, 1));       // recovery 3
  b.add(8, plan(3, 1));       // recovery 3
  ev::recovery_done r;
  r.generation = 3;
  r.duration_s = 4;
  b.add(12, r);
  b.add(12, step(2, 3, 1.0));  // recovery 4 - 1
  const auto g = b.figures();
  EXPECT_DOUBLE_EQ(g.start_s, 0.5);
  EXPECT_DOUBLE_EQ(g.recovery_s, 9);
  EXPECT_DOUBLE_EQ(g.productive_s, 2);
  EXPECT_DOUBLE_EQ(g.other_s, 0);
}

// Steps done after the last line and held by the survivors are progress;
// steps computed again after a resume from before them are recovery.
TEST(goodput, held_steps_are_progress_and_recomputed_steps_are_recovery) {
  goodput_book b;
  b.add(10, ev::coordinator_started{});
  b.add(10, plan(1, 0));
  b.add(12, step(2, 1, 1.0));  // productive 2, start 0
  b.add(20, plan(2, 2));       // detection 8, of which steps 3..5 (below)
  ev::recovery_done r;
  r.generation = 2;
  r.resumed_step = 5;
  r.duration_s = 3;
  b.add(23, r);                // steps 3..5 held: productive 5, recovery 5
  b.add(23, step(6, 2, 1.0));  // productive 6, recovery + 3 - 1
  EXPECT_DOUBLE_EQ(b.figures().productive_s, 6);
  EXPECT_DOUBLE_EQ(b.figures().recovery_s, 7);
  b.add(30, plan(3, 4));  // every holder of 5 and 6 lost: from the checkpoint at 4; detection 7
  r.generation = 3;
  r.resumed_step = 4;
  r.duration_s = 2;
  b.add(32, r);
  b.add(36, step(8, 3, 1.0));  // 5 and 6 again (recovery 2, the first inside duration_s), 7 and 8 new
  const auto g = b.figures();
  EXPECT_DOUBLE_EQ(g.productive_s, 8);
  EXPECT_DOUBLE_EQ(g.recovery_s, 7 + 7 + 2 + 1);
  EXPECT_DOUBLE_EQ(g.other_s, 1);
  EXPECT_DOUBLE_EQ(g.wall_s, 26);
}

// `dtactor train` lines carry no step_s: the time between lines counts.
TEST(goodput, lines_without_step_s_count_the_time_between_them) {
  goodput_book b;
  ev::job_started j;
  b.add(10, j);
  ev::step_completed s;
  s.step = 10;
  b.add(15, s);  // start 5
  s.step = 20;
  b.add(18, s);  // productive 3
  const auto g = b.figures();
  EXPECT_DOUBLE_EQ(g.start_s, 5);
  EXPECT_DOUBLE_EQ(g.productive_s, 3);
  EXPECT_DOUBLE_EQ(g.wall_s, 8);
}

// A second start of the run directory: its time to the first step is start
// again; the downtime between the sessions is other.
TEST(goodput, a_resumed_run_counts_each_start) {
  goodput_book b;
  b.add(10, ev::coordinator_started{});
  b.add(10, plan(1, 0));
  b.add(12, step(1, 1, 1.0));  // start 1 (from 10)
  b.add(20, ev::coordinator_started{});
  b.add(25, plan(1, 1));
  b.add(26, step(2, 1, 1.0));  // start 5
  const auto g = b.figures();
  EXPECT_DOUBLE_EQ(g.wall_s, 16);
  EXPECT_DOUBLE_EQ(g.start_s, 1 + 5);
  EXPECT_DOUBLE_EQ(g.productive_s, 2);
  EXPECT_DOUBLE_EQ(g.recovery_s, 0);
  EXPECT_DOUBLE_EQ(g.other_s, 8);
}

TEST(goodput, the_journal_line_round_trips) {
  ev::goodput g = a_job_with_everything().figures();
  const auto j = ev::to_json(g);
  EXPECT_DOUBLE_EQ(j.at("ratio").get<double>(), 14.5 / 50);
  auto line = j;
  line["event"] = "goodput";
  auto back = ev::from_json(line);
  ASSERT_TRUE(back) << back.message();
  EXPECT_DOUBLE_EQ(std::get<ev::goodput>(back.value()).recovery_s, 8.5);
}

}  // namespace
}  // namespace dtactor
