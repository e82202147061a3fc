// The job actor's pure bookkeeping: step reports folded into completed steps,
// recovery accounting from a plan to its first completed step, the verdict
// at the end. Time is passed in, never read.
#include "actors/job_progress.hpp"
#include "actors/wire_enums.hpp"

#include <gtest/gtest.h>

using namespace dtactor;
using namespace std::chrono_literals;

namespace {

pb::step_report report(int32_t rank, int64_t step, double loss, int64_t samples, double step_s, int32_t covered = 1) {
  pb::step_report r;
  r.set_global_rank(rank);
  r.set_step(step);
  r.set_loss(loss);
  r.set_samples(samples);
  r.set_step_s(step_s);
  r.set_allreduce_s(step_s / 2);
  r.set_steps_covered(covered);
  r.set_lr(0.01);
  return r;
}

pb::rank_status ready(int64_t step, ev::state_source source, int32_t root = 0) {
  pb::rank_status s;
  s.set_status(pb::rank_status::STATE_READY);
  s.set_step(step);
  s.set_state_source(to_wire(source));
  s.set_state_root(root);
  return s;
}

}  // namespace

TEST(step_table, a_step_completes_when_every_rank_reported_it_and_times_are_per_step) {
  step_table t;
  EXPECT_FALSE(t.add(report(0, 10, 1.0, 60, 0.4, 2), 3, 2));
  auto done = t.add(report(1, 10, 4.0, 20, 0.8, 2), 3, 2);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->step, 10);
  EXPECT_EQ(done->generation, 3u);
  EXPECT_EQ(done->world_size, 2);
  EXPECT_DOUBLE_EQ(done->loss, (1.0 * 60 + 4.0 * 20) / 80);
  EXPECT_EQ(done->samples, 80);
  EXPECT_DOUBLE_EQ(done->samples_per_s, 80 / 0.8);  // the slowest rank
  EXPECT_DOUBLE_EQ(done->step_s, 0.4);               // 0.8 s over 2 steps
  EXPECT_DOUBLE_EQ(done->allreduce_s.value_or(-1), 0.2);
  EXPECT_EQ(t.pending(), 0u);
}

TEST(step_table, where_the_step_went_is_the_slowest_ranks_per_step_and_absent_when_not_reported) {
  step_table t;
  auto a = report(0, 6, 1.0, 10, 0.6, 2), b = report(1, 6, 1.0, 10, 0.6, 2);
  a.set_compute_s(0.8), a.set_update_s(0.2), a.set_gather_s(0.1), a.set_pass_gather_s(0.5);
  b.set_compute_s(0.6), b.set_update_s(0.4), b.set_gather_s(0.3), b.set_pass_gather_s(0.2);
  EXPECT_FALSE(t.add(a, 1, 2));
  auto done = t.add(b, 1, 2);
  ASSERT_TRUE(done);
  EXPECT_DOUBLE_EQ(done->compute_s.value_or(-1), 0.4);  // 0.8 s over 2 steps
  EXPECT_DOUBLE_EQ(done->update_s.value_or(-1), 0.2);
  EXPECT_DOUBLE_EQ(done->gather_s.value_or(-1), 0.15);
  EXPECT_DOUBLE_EQ(done->pass_gather_s.value_or(-1), 0.25);
  auto plain = t.add(report(0, 7, 1.0, 10, 0.3), 1, 1);  // a rank that reports none of them (train.zero = 0: no gather)
  ASSERT_TRUE(plain);
  EXPECT_FALSE(plain->compute_s || plain->update_s || plain->gather_s || plain->pass_gather_s);
}

TEST(step_table, a_completed_step_forgets_older_incomplete_ones) {
  step_table t;
  EXPECT_FALSE(t.add(report(0, 4, 1, 1, 0.1), 1, 2));  // rank 1's report of step 4 never comes
  EXPECT_FALSE(t.add(report(0, 5, 1, 1, 0.1), 1, 2));
  EXPECT_EQ(t.pending(), 2u);
  EXPECT_TRUE(t.add(report(1, 5, 1, 1, 0.1), 1, 2));
  EXPECT_EQ(t.pending(), 0u);
}

TEST(outer_step, a_report_that_closed_two_windows_gives_the_payload_and_exchange_per_window) {
  auto r = report(0, 40, 1.0, 10, 0.3);
  r.set_outer_steps(2);
  r.set_outer_inner_steps(20);
  r.set_outer_payload_bytes(8000);
  r.set_outer_exchange_s(0.5);
  r.set_outer_window_s(3.0);
  r.set_pseudo_grad_norm(0.75);
  const ev::outer_step e = outer_step_of(r, 6, 3);
  EXPECT_EQ(e.step, 40);
  EXPECT_EQ(e.generation, 6u);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.inner_steps, 20);
  EXPECT_EQ(e.payload_bytes, 4000u);
  EXPECT_DOUBLE_EQ(e.exchange_s, 0.25);
  EXPECT_DOUBLE_EQ(e.window_s, 3.0);
  EXPECT_DOUBLE_EQ(e.pseudo_grad_norm, 0.75);
}

TEST(recovery, the_first_generation_is_the_start_and_no_recovery) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(1, true, plan_cause::node_joined, false, t0, 0);
  EXPECT_EQ(rec.cause, plan_cause::start);
  EXPECT_FALSE(complete_generation(rec, 1, 2, t0 + 1s));
  // A coordinator that restarts into a running job plans a restart.
  EXPECT_EQ(begin_generation(4, true, plan_cause::restart, false, t0, 0).cause, plan_cause::restart);
}

TEST(recovery, duration_runs_from_the_plan_to_the_first_completed_step_and_lost_steps_are_computed) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(3, false, plan_cause::node_lost, false, t0, 120);
  EXPECT_FALSE(note_ready(rec, ready(118, ev::state_source::local)));
  EXPECT_FALSE(note_ready(rec, ready(117, ev::state_source::local)));
  auto done = complete_generation(rec, 119, 1, t0 + 1500ms);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->generation, 3u);
  EXPECT_EQ(done->cause, plan_cause::node_lost);
  EXPECT_EQ(done->resumed_step, 118);  // the highest step a rank was READY at
  EXPECT_EQ(done->lost_steps, 2);      // 120 had completed; the generation went on from 118
  EXPECT_DOUBLE_EQ(done->duration_s, 1.5);
  EXPECT_FALSE(complete_generation(rec, 120, 1, t0 + 2s));  // once
}

TEST(recovery, without_a_ready_report_the_generation_resumed_before_its_first_step) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(2, false, plan_cause::node_left, true, t0, 40);
  auto done = complete_generation(rec, 41, 1, t0 + 100ms);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->resumed_step, 40);
  EXPECT_EQ(done->lost_steps, 0);
  EXPECT_TRUE(done->drain);
}

// Where a recovery's time went: the slowest rank's plan-to-READY (its
// group, then its agreement and state, each the slowest rank's), and the
// rest of the duration up to the first step.
TEST(recovery, its_duration_is_split_into_the_slowest_ranks_group_and_state_and_the_first_step) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(3, false, plan_cause::node_lost, false, t0, 40, 1);
  auto a = ready(40, ev::state_source::local);
  a.set_switch_s(0.20);
  a.set_group_s(0.15);
  auto b = ready(40, ev::state_source::peer, 0);
  b.set_switch_s(0.30);
  b.set_group_s(0.10);
  note_ready(rec, a);
  note_ready(rec, b);
  auto done = complete_generation(rec, 41, 2, t0 + 450ms);
  ASSERT_TRUE(done);
  EXPECT_DOUBLE_EQ(done->duration_s, 0.45);
  ASSERT_TRUE(done->ready_s && done->drain_s && done->group_s && done->state_s && done->first_step_s);
  EXPECT_DOUBLE_EQ(*done->drain_s, 0.0);  // no rank reported one
  EXPECT_DOUBLE_EQ(*done->ready_s, 0.30);
  EXPECT_DOUBLE_EQ(*done->group_s, 0.15);
  EXPECT_NEAR(*done->state_s, 0.20, 1e-12);  // b: 0.30 - 0.10
  EXPECT_NEAR(*done->first_step_s, 0.15, 1e-12);
  // Without a READY report there is nothing to split.
  auto quiet = begin_generation(4, false, plan_cause::node_lost, false, t0, 41, 1);
  auto q = complete_generation(quiet, 42, 1, t0 + 100ms);
  ASSERT_TRUE(q);
  EXPECT_FALSE(q->ready_s || q->drain_s || q->group_s || q->state_s || q->first_step_s);
}

// A drain plan: the ranks that train on to the agreed boundary report how
// long that took (drain_s), and the joiner's plan-to-group includes the
// same wait at the rendezvous. The group is what the slowest plan-to-group
// took beyond the slowest drain.
TEST(recovery, a_drains_wait_for_the_boundary_is_its_own_phase_and_not_the_groups) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(5, false, plan_cause::node_joined, true, t0, 60);
  auto trained_on = ready(60, ev::state_source::local);
  trained_on.set_drain_s(2.0);
  trained_on.set_group_s(2.10);
  trained_on.set_switch_s(2.30);
  auto joiner = ready(60, ev::state_source::peer, 0);
  joiner.set_group_s(2.12);
  joiner.set_switch_s(2.20);
  note_ready(rec, trained_on);
  note_ready(rec, joiner);
  auto done = complete_generation(rec, 61, 2, t0 + 3000ms);
  ASSERT_TRUE(done);
  ASSERT_TRUE(done->ready_s && done->drain_s && done->group_s && done->state_s && done->first_step_s);
  EXPECT_DOUBLE_EQ(*done->ready_s, 2.30);
  EXPECT_DOUBLE_EQ(*done->drain_s, 2.0);
  EXPECT_NEAR(*done->group_s, 0.12, 1e-12);
  EXPECT_NEAR(*done->state_s, 0.20, 1e-12);  // trained_on: 2.30 - 2.10
  EXPECT_NEAR(*done->first_step_s, 0.70, 1e-12);
}

TEST(recovery, state_taken_from_a_peer_or_disk_is_reported_once) {
  auto rec = begin_generation(2, false, plan_cause::node_joined, true, clock_time{}, 10);
  auto first = note_ready(rec, ready(10, ev::state_source::peer, 1));
  ASSERT_TRUE(first);
  EXPECT_EQ(first->source, ev::state_source::peer);
  EXPECT_EQ(first->root, 1);
  EXPECT_EQ(first->generation, 2u);
  EXPECT_FALSE(note_ready(rec, ready(10, ev::state_source::peer, 1)));
  EXPECT_FALSE(note_ready(rec, ready(10, ev::state_source::fresh)));
}

TEST(verdict, every_rank_at_max_steps_with_one_digest_is_finished) {
  auto v = verdict({{0, "abc"}, {1, "abc"}}, 100, 100, 2, 2, {{"accuracy", 0.9}});
  EXPECT_EQ(v.how, ev::outcome::finished);
  EXPECT_EQ(v.params_digest, "abc");
  EXPECT_EQ(v.exit_code, 0);
  EXPECT_FALSE(v.digests_differ);
  EXPECT_DOUBLE_EQ(v.metrics.at("accuracy"), 0.9);
}

TEST(verdict, below_max_steps_is_a_stop_and_different_digests_fail) {
  EXPECT_EQ(verdict({{0, "a"}}, 40, 100, 1, 1, {}).how, ev::outcome::stopped);
  auto v = verdict({{0, "a"}, {1, "b"}}, 100, 100, 1, 2, {});
  EXPECT_TRUE(v.digests_differ);
  EXPECT_EQ(v.exit_code, 1);
  EXPECT_EQ(v.reason, "ranks finished with different parameters");
}

namespace dtactor {
namespace {

// train.sync = diloco: the survivors go on from their window (no step
// lost); the lost workers' inner steps since the anchor are counted.
TEST(recovery, a_diloco_window_lost_with_its_workers_is_counted_in_inner_steps) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(3, false, plan_cause::node_lost, false, t0, 130, 2);
  auto r = ready(137, ev::state_source::local);
  r.set_window_steps(37);
  r.set_replayed_slices(74);  // every rank says the same
  EXPECT_FALSE(note_ready(rec, r));
  r.set_window_steps(35);
  r.set_skipped_steps(2);
  EXPECT_FALSE(note_ready(rec, r));
  auto done = complete_generation(rec, 138, 2, t0 + 1s);
  ASSERT_TRUE(done);
  EXPECT_EQ(done->lost_steps, 0);
  ASSERT_TRUE(done->lost_inner_steps);
  EXPECT_EQ(*done->lost_inner_steps, 74);  // 37 inner steps each of 2 lost workers
  ASSERT_TRUE(done->replayed_slices);
  EXPECT_EQ(*done->replayed_slices, 74);  // the survivors trained those slices again
  // Synchronous training reports none.
  auto sync = begin_generation(4, false, plan_cause::node_lost, false, t0, 130, 1);
  EXPECT_FALSE(note_ready(sync, ready(130, ev::state_source::local)));
  auto d2 = complete_generation(sync, 131, 2, t0 + 1s);
  ASSERT_TRUE(d2);
  EXPECT_FALSE(d2->lost_inner_steps);
  EXPECT_FALSE(d2->replayed_slices);
}

}  // namespace
}  // namespace dtactor

// A generation some of whose ranks were a node's warm spares says how many
// (recovery_done's spare_ranks); one without says nothing.
TEST(recovery, ranks_that_were_warm_spares_are_counted) {
  const clock_time t0{std::chrono::hours(1)};
  auto rec = begin_generation(5, false, plan_cause::rank_exited, false, t0, 50);
  auto spare = ready(50, ev::state_source::peer);
  spare.set_from_spare(true);
  (void)note_ready(rec, spare);
  (void)note_ready(rec, ready(50, ev::state_source::local));
  auto done = complete_generation(rec, 51, 2, t0 + 100ms);
  ASSERT_TRUE(done);
  ASSERT_TRUE(done->spare_ranks);
  EXPECT_EQ(*done->spare_ranks, 1);
  auto plain = begin_generation(6, false, plan_cause::rank_exited, false, t0, 60);
  (void)note_ready(plain, ready(60, ev::state_source::local));
  auto none = complete_generation(plain, 61, 2, t0 + 100ms);
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->spare_ranks);
}
