// Which checkpoint a plan without a state holder names, and what a rank's
// refusal of one changes (actors/checkpoint_choice.hpp): pure functions.
#include "actors/checkpoint_choice.hpp"

#include <gtest/gtest.h>

using namespace dtactor;

TEST(checkpoint_choice, a_job_starting_over_plans_none_of_the_stored_checkpoints) {
  auto l = ledger_at_start({10, 20}, -1);
  EXPECT_TRUE(l.committed.empty());
  EXPECT_EQ(plan_checkpoint(l), -1);
}

TEST(checkpoint_choice, a_resumed_job_may_fall_back_to_older_checkpoints_but_not_to_newer_ones_skipped_at_start) {
  auto l = ledger_at_start({10, 20, 30}, 20);
  EXPECT_EQ(l.committed, (std::set<int64_t>{10, 20}));
  EXPECT_EQ(plan_checkpoint(l), 20);
  // The one resumed from counts even when the listing missed it.
  EXPECT_EQ(ledger_at_start({}, 7).committed, (std::set<int64_t>{7}));
}

TEST(checkpoint_choice, a_refused_checkpoint_is_never_planned_again_and_the_plan_falls_back_step_by_step) {
  auto l = ledger_at_start({10, 20, 30}, 30);
  auto r = refuse_checkpoint(l, 30, "rank 0 on node 'a'", "checksum mismatch in part 'p'");
  EXPECT_TRUE(r.newly_bad);
  EXPECT_FALSE(r.exhausted);
  EXPECT_EQ(r.fallback, 20);
  EXPECT_EQ(plan_checkpoint(l), 20);
  EXPECT_EQ(r.line,
            "rank 0 on node 'a' refused the checkpoint at step 30 (checksum mismatch in part 'p'): marked bad for this job; the next "
            "generation resumes from the checkpoint at step 20");
  // Another rank's report of the same checkpoint changes nothing.
  auto again = refuse_checkpoint(l, 30, "rank 1 on node 'b'", "checksum mismatch in part 'q'");
  EXPECT_FALSE(again.newly_bad);
  EXPECT_EQ(again.fallback, 20);
  EXPECT_EQ(refuse_checkpoint(l, 20, "rank 0", "x").fallback, 10);
  EXPECT_EQ(plan_checkpoint(l), 10);
  EXPECT_EQ(l.bad, (std::set<int64_t>{20, 30}));
}

TEST(checkpoint_choice, with_every_checkpoint_refused_the_job_cannot_resume_and_says_so_in_one_line) {
  auto l = ledger_at_start({10}, 10);
  auto r = refuse_checkpoint(l, 10, "rank 0 on node 'a'", "part 'p' is missing");
  EXPECT_TRUE(r.newly_bad);
  EXPECT_TRUE(r.exhausted);
  EXPECT_EQ(r.fallback, -1);
  EXPECT_EQ(plan_checkpoint(l), -1);
  EXPECT_EQ(r.line.find('\n'), std::string::npos);
  EXPECT_EQ(r.line,
            "rank 0 on node 'a' refused the checkpoint at step 10 (part 'p' is missing): no other committed checkpoint is left that no "
            "rank refused; the job cannot resume (restore the checkpoint store, or start over with --no-resume)");
}

TEST(checkpoint_choice, a_new_commit_at_a_refused_step_clears_its_mark_and_the_store_kept_set_replaces_the_known_one) {
  auto l = ledger_at_start({5, 10}, 10);
  (void)refuse_checkpoint(l, 10, "rank 0", "checksum mismatch");
  EXPECT_EQ(plan_checkpoint(l), 5);
  checkpoint_committed(l, 10, {5, 10});
  EXPECT_TRUE(l.bad.empty());
  EXPECT_EQ(plan_checkpoint(l), 10);
  // Rotation took 5 and 10 away: they are never planned (a rank would find no manifest).
  checkpoint_committed(l, 20, {15, 20});
  EXPECT_EQ(l.committed, (std::set<int64_t>{15, 20}));
  // A commit whose kept set is not known adds its step only.
  checkpoint_committed(l, 25, {});
  EXPECT_EQ(l.committed, (std::set<int64_t>{15, 20, 25}));
  // An older step committed late (a slow generation) does not hide the newest.
  checkpoint_committed(l, 12, {});
  EXPECT_EQ(plan_checkpoint(l), 25);
}
