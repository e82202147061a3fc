// How a job ends: divergence, NaN, stops, and recoveries timed on the actor
// clock (tests/coordinator_actors_fixture.hpp).
#include <gtest/gtest.h>

#include "coordinator_actors_fixture.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace dtactor::coordinator_test;
using namespace std::chrono_literals;

TEST_F(coordinator_actors, ranks_with_different_parameters_end_the_job_with_exit_code_1) {
  start(coord_opts(1), 5);
  auto code = await_end(*this, job);
  send(joined("a", 2));
  advance(100ms);
  send(finished_from("a", 0, 5, 1, "d1"));
  EXPECT_EQ(*code, -1);
  send(finished_from("a", 1, 5, 1, "d2"));
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_TRUE(end[0].digests_differ);
  EXPECT_EQ(end[0].exit_code, 1);
  EXPECT_EQ(*code, 1);
}

TEST_F(coordinator_actors, a_rank_reporting_diverged_parameters_fails_the_job_and_other_failures_do_not) {
  start(coord_opts(1), 50);
  auto code = await_end(*this, job);
  send(joined("a", 2));
  advance(100ms);
  // An ordinary failure: recorded, the membership actor re-plans; the job goes on.
  auto failed = status_from("a", 0, pb::rank_status::STATE_FAILED, 1);
  failed.env.mutable_rank_status()->set_detail("parameters differ is not a signal by itself");
  send(failed);
  EXPECT_TRUE(of<ev::job_ended>().empty());
  ASSERT_EQ(of<ev::rank_down>().size(), 1u);
  EXPECT_TRUE(of<ev::rank_down>()[0].failed);
  auto diverged = status_from("a", 1, pb::rank_status::STATE_FAILED, 1);
  diverged.env.mutable_rank_status()->set_global_rank(1);
  diverged.env.mutable_rank_status()->set_failure(pb::rank_status::FAILURE_PARAMETERS_DIFFER);
  diverged.env.mutable_rank_status()->set_detail("parameters differ between ranks at step 7");
  send(diverged);
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::failed);
  EXPECT_EQ(end[0].reason, "rank 1: parameters differ between ranks at step 7");
  EXPECT_EQ(*code, 1);
  auto bye = wire.with(pb::envelope::kShutdown, "peer-a");
  ASSERT_EQ(bye.size(), 1u);
  EXPECT_EQ(bye[0].env.shutdown().reason(), "job failed");
}

TEST_F(coordinator_actors, a_rank_whose_loss_became_nan_fails_the_job) {
  start(coord_opts(1), 50);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  advance(100ms);
  auto nan = status_from("a", 0, pb::rank_status::STATE_FAILED, 1);
  nan.env.mutable_rank_status()->set_failure(pb::rank_status::FAILURE_DIVERGED);
  nan.env.mutable_rank_status()->set_detail("loss became nan at step 3");
  send(nan);
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::failed);
  EXPECT_EQ(end[0].reason, "rank 0: loss became nan at step 3");
  EXPECT_EQ(*code, 1);
}

TEST_F(coordinator_actors, a_stop_asks_every_node_for_a_final_checkpoint_and_ends_when_every_rank_stopped) {
  start(coord_opts(1), 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  caf::anon_send(job, stop_atom::value, std::string("coordinator stopped by signal 2"));
  run();
  ASSERT_EQ(of<ev::job_stopping>().size(), 1u);
  EXPECT_TRUE(ms().stopping);
  auto asks = wire.with(pb::envelope::kShutdown);
  ASSERT_EQ(asks.size(), 2u);
  EXPECT_TRUE(asks[0].env.shutdown().checkpoint());
  EXPECT_TRUE(of<ev::job_ended>().empty());
  send(finished_from("a", 0, 12, 1, "d"));
  send(finished_from("b", 1, 12, 1, "d"));
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::stopped);
  EXPECT_TRUE(end[0].final_checkpoint);
  EXPECT_EQ(end[0].step, 12);
  EXPECT_EQ(*code, 0);
  auto bye = wire.with(pb::envelope::kShutdown);
  ASSERT_EQ(bye.size(), 4u);
  EXPECT_FALSE(bye[3].env.shutdown().checkpoint());
  // Nodes leaving during the stop start no new generation.
  send(leave_from("b", "signal 2"));
  advance(500ms);
  EXPECT_EQ(js().generation, 1u);
}

TEST_F(coordinator_actors, a_stop_the_ranks_do_not_answer_ends_at_the_stop_timeout_without_a_final_checkpoint) {
  start(coord_opts(1), 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  advance(100ms);
  send(step_from("a", 0, 7, 1));
  caf::anon_send(job, stop_atom::value, std::string("stop"));
  run();
  advance(29s, 1s);
  EXPECT_EQ(*code, -1);
  advance(2s, 1s);
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::stopped);
  EXPECT_FALSE(end[0].final_checkpoint);
  EXPECT_EQ(end[0].step, 7);
  EXPECT_EQ(*code, 0);
}

TEST_F(coordinator_actors, a_stop_before_any_generation_ends_at_once) {
  start(coord_opts(2), 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));  // waits for a second node
  caf::anon_send(job, stop_atom::value, std::string("stop"));
  run();
  ASSERT_EQ(of<ev::job_ended>().size(), 1u);
  EXPECT_FALSE(of<ev::job_ended>()[0].final_checkpoint);
  EXPECT_EQ(*code, 0);
}

// Every node left (each gave its ranks up, say): a stop has nobody to wait
// for and ends at once instead of after the stop timeout.
TEST_F(coordinator_actors, a_stop_after_every_node_left_ends_at_once) {
  start(coord_opts(1), 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  advance(100ms);
  ASSERT_EQ(of<ev::generation_started>().size(), 1u);
  send(leave_from("a", "every rank given up"));
  caf::anon_send(job, stop_atom::value, std::string("stop"));
  run();
  ASSERT_EQ(of<ev::job_ended>().size(), 1u);
  EXPECT_EQ(of<ev::job_ended>()[0].how, ev::outcome::stopped);
  EXPECT_EQ(of<ev::job_ended>()[0].reason, "stop; no node is connected");
  EXPECT_FALSE(of<ev::job_ended>()[0].final_checkpoint);
  EXPECT_EQ(*code, 0);
}

// Ctrl-C to a shell job reaches the coordinator and every node at once, and
// every node's leave (its ranks still training) may come before the
// coordinator's own stop. Those ranks get the stop too (through their
// nodes) and write its final checkpoint: the stop waits for them while
// their nodes are heard from (refused heartbeats count), and ends at once
// once they are not. Before, it ended at once ("no node is connected") and
// the job stopped without its final checkpoint.
TEST_F(coordinator_actors, a_stop_just_after_every_node_left_draining_waits_for_their_ranks) {
  start(coord_opts(1), 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  advance(100ms);
  ASSERT_EQ(of<ev::generation_started>().size(), 1u);
  send(step_from("a", 0, 7, 1));
  auto leave = leave_from("a", "signal 2");
  leave.env.mutable_leave()->set_draining(true);
  send(leave);
  advance(600ms);
  inbound hb{links::nodes, "peer-a", node_envelope("a", 1)};
  hb.env.mutable_heartbeat()->set_seq(1);
  send(hb);  // refused (not a member), but heard from
  advance(600ms);
  caf::anon_send(job, stop_atom::value, std::string("stop"));
  run();
  EXPECT_TRUE(of<ev::job_ended>().empty()) << "the draining node's rank was told to stop and is waited for";
  auto fin = status_from("a", 0, pb::rank_status::STATE_FINISHED, 1);
  fin.env.mutable_rank_status()->set_step(8);
  send(fin);
  run();
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::stopped);
  EXPECT_EQ(end[0].reason.find("no node is connected"), std::string::npos) << end[0].reason;
  EXPECT_EQ(*code, 0);
}

TEST_F(coordinator_actors, a_stop_after_a_draining_node_fell_silent_ends_at_once) {
  start(coord_opts(1), 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  advance(100ms);
  auto leave = leave_from("a", "signal 2");
  leave.env.mutable_leave()->set_draining(true);
  send(leave);
  advance(1100ms);  // past the heartbeat timeout: its ranks stopped with it
  caf::anon_send(job, stop_atom::value, std::string("stop"));
  run();
  ASSERT_EQ(of<ev::job_ended>().size(), 1u);
  EXPECT_EQ(of<ev::job_ended>()[0].reason, "stop; no node is connected");
  EXPECT_EQ(*code, 0);
}

// While a node is there, a stop waits for its ranks (up to the stop timeout).
TEST_F(coordinator_actors, a_stop_with_a_node_there_waits_for_its_ranks) {
  start(coord_opts(1), 100);
  send(joined("a", 1));
  advance(100ms);
  caf::anon_send(job, stop_atom::value, std::string("stop"));
  run();
  EXPECT_TRUE(of<ev::job_ended>().empty());
}

// A generation's READY that arrives after the next plan (the rank read the
// checkpoint there; the next generation's ranks then say they kept their
// own state or took a peer's): the restore is journaled for the generation
// it happened in. Older generations' READYs are not.
TEST_F(coordinator_actors, a_restore_reported_after_the_next_plan_is_journaled_for_its_generation) {
  start(coord_opts(1), 100);
  send(joined("a", 1));
  advance(100ms);
  ASSERT_EQ(js().generation, 1u);
  send(joined("b", 1));
  advance(100ms);
  ASSERT_EQ(js().generation, 2u);
  auto late = status_from("a", 0, pb::rank_status::STATE_READY, 1);
  late.env.mutable_rank_status()->set_step(40);
  late.env.mutable_rank_status()->set_state_source(pb::rank_status::ORIGIN_DISK);
  send(late);
  auto restored = of<ev::checkpoint_restored>();
  ASSERT_EQ(restored.size(), 1u);
  EXPECT_EQ(restored[0].generation, 1u);
  EXPECT_EQ(restored[0].source, ev::state_source::disk);
  EXPECT_EQ(restored[0].step, 40);
  send(late);  // once per generation
  EXPECT_EQ(of<ev::checkpoint_restored>().size(), 1u);
  send(leave_from("b", "SIGTERM"));
  advance(100ms);
  ASSERT_EQ(js().generation, 3u);
  send(late);  // two generations back
  EXPECT_EQ(of<ev::checkpoint_restored>().size(), 1u);
}

TEST_F(coordinator_actors, a_recovery_is_timed_on_the_actor_clock_and_counts_no_lost_step) {
  start(coord_opts(1), 100);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  for (int64_t s = 1; s <= 4; ++s) {
    send(step_from("a", 0, s, 1));
    send(step_from("b", 1, s, 1));
  }
  ASSERT_EQ(of<ev::step_completed>().size(), 4u);
  EXPECT_TRUE(of<ev::recovery_done>().empty());  // generation 1 is the start, not a recovery
  send(leave_from("b", "SIGTERM"));
  advance(100ms);
  ASSERT_EQ(js().generation, 2u);
  const auto planned_at = now();
  advance(250ms);
  auto ready = status_from("a", 0, pb::rank_status::STATE_READY, 2);
  ready.env.mutable_rank_status()->set_step(4);
  ready.env.mutable_rank_status()->set_state_source(pb::rank_status::ORIGIN_LOCAL);
  send(ready);
  send(step_from("a", 0, 5, 2));
  auto rec = of<ev::recovery_done>();
  ASSERT_EQ(rec.size(), 1u);
  EXPECT_EQ(rec[0].generation, 2u);
  EXPECT_EQ(rec[0].cause, ev::plan_cause::node_left);
  EXPECT_EQ(rec[0].resumed_step, 4);
  EXPECT_EQ(rec[0].lost_steps, 0);
  EXPECT_GE(rec[0].duration_s, 0.25);
  EXPECT_LE(rec[0].duration_s, std::chrono::duration<double>(now() - planned_at).count() + 0.1);
  EXPECT_TRUE(of<ev::checkpoint_restored>().empty());  // a kept its own state
}
