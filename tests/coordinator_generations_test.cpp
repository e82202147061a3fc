// The coordinator's generations: ranks planned as they warm, joins, drains,
// a restarted coordinator's adoption, and plans on the wire
// (tests/coordinator_actors_fixture.hpp).
#include <gtest/gtest.h>

#include "coordinator_actors_fixture.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace dtactor::coordinator_test;
using namespace std::chrono_literals;

TEST_F(coordinator_actors, without_a_job_actor_plans_start_at_step_0) {
  auto o = coord_opts(1);
  members = spawn(membership_actor, o, wire.sink(), job_handle{});
  run();
  send(joined("a", 1));
  advance(100ms);
  auto plans = wire.with(pb::envelope::kGenerationPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].env.generation_plan().start_step(), 0);
  // Reports have nowhere to go and are counted.
  send(step_from("a", 0, 1, 1));
  EXPECT_EQ(ms().dropped, 1u);
}

// -- fault handling ---------------------------------------------------------------

TEST_F(coordinator_actors, ranks_are_planned_as_they_report_idle_and_an_exit_aborts) {
  start(coord_opts(1));
  send(register_from("a", 2));  // ranks still loading
  advance(100ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);
  send(status_from("a", 1, pb::rank_status::STATE_IDLE));
  advance(100ms);
  auto g1 = last_plan("peer-a");
  EXPECT_EQ(g1.generation(), 1u);
  ASSERT_EQ(g1.ranks_size(), 1);
  EXPECT_EQ(g1.ranks(0).local_rank(), 1);
  EXPECT_EQ(g1.ranks(0).global_rank(), 0);
  EXPECT_EQ(cause_of(g1), plan_cause::start);
  EXPECT_FALSE(g1.drain());
  trained();
  // The agent may also pass a rank's own envelope on.
  inbound idle = status_from("a", 0, pb::rank_status::STATE_IDLE);
  idle.env.set_sender(sender_id::of_rank("a", 0).to_string());
  idle.env.set_incarnation(77);
  send(inbound{idle.link, idle.peer, idle.env});
  advance(100ms);
  auto g2 = last_plan("peer-a");
  expect_plan(g2, 2u, 2, "rank_ready", true);
  EXPECT_EQ(g2.state_root(), 1);  // local rank 1 holds the state, now global rank 1
  send(status_from("a", 1, pb::rank_status::STATE_EXITED, 2));
  advance(100ms);
  auto g3 = last_plan("peer-a");
  expect_plan(g3, 3u, 1, "rank_exited", false);
  // Statuses still reach the job actor (fenced there by generation: the
  // relayed one carried generation 0 while the job was in 1).
  EXPECT_EQ(js().stale_reports, 1u);
  auto planned = of<ev::generation_started>();
  ASSERT_EQ(planned.size(), 3u);
  EXPECT_EQ(planned[2].cause, ev::plan_cause::rank_exited);
  EXPECT_EQ(planned[1].world_size, 2);
  EXPECT_TRUE(planned[1].drain);
}

// A rank whose place a node's warm spare took (EXITED with
// spare_takes_over): the slot is ready again at once, and the next plan,
// made in the same moment (no tick, no settling), keeps the world at full
// size; rank_exited journals the spare.
TEST_F(coordinator_actors, a_rank_replaced_by_a_warm_spare_is_planned_in_at_once_at_full_size) {
  auto o = coord_opts(1);
  o.membership.settle = 300ms;
  start(o);
  send(register_from("a", 2));
  send(status_from("a", 0, pb::rank_status::STATE_IDLE));
  send(status_from("a", 1, pb::rank_status::STATE_IDLE));
  advance(400ms);
  ASSERT_EQ(last_plan("peer-a").world_size(), 2);
  trained();
  const auto plans = wire.count(pb::envelope::kGenerationPlan);
  inbound exited = status_from("a", 1, pb::rank_status::STATE_EXITED, last_plan("peer-a").generation());
  exited.env.mutable_rank_status()->set_spare_takes_over(true);
  send(exited);  // no time passes
  ASSERT_EQ(wire.count(pb::envelope::kGenerationPlan), plans + 1);
  auto g = last_plan("peer-a");
  expect_plan(g, g.generation(), 2, "rank_exited", false);
  auto down = of<ev::rank_down>();
  ASSERT_FALSE(down.empty());
  EXPECT_EQ(down.back().spare, std::optional<bool>(true));
}

TEST_F(coordinator_actors, joins_settle_and_a_running_job_takes_a_new_node_with_a_drain_plan) {
  auto o = coord_opts(1);
  o.membership.settle = 300ms;
  start(o);
  send(joined("a", 1));
  advance(200ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);  // the first generation settles too
  send(joined("b", 1));
  keep_alive({"a", "b"}, 200ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);  // from b's arrival
  keep_alive({"a", "b"}, 200ms);
  EXPECT_EQ(last_plan("peer-a").world_size(), 2);
  EXPECT_EQ(of<ev::node_joined>().size(), 2u);
  EXPECT_EQ(of<ev::node_joined>()[1].node, "b");

  trained();
  send(step_from("a", 0, 7, 1));  // a has done step 7; b's report of it comes after the next plan
  send(register_from("c", 1));  // joins a running job
  auto ack = wire.with(pb::envelope::kRegisterAck, "peer-c");
  ASSERT_EQ(ack.size(), 1u);
  EXPECT_TRUE(ack[0].env.register_ack().accepted());
  keep_alive({"a", "b", "c"}, 500ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-c"), 0u);  // not ready yet
  send(status_from("c", 0, pb::rank_status::STATE_IDLE));
  keep_alive({"a", "b", "c"}, 200ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-c"), 0u);  // settling
  keep_alive({"a", "b", "c"}, 200ms);
  auto g2 = last_plan("peer-c");
  expect_plan(g2, 2u, 3, "node_joined", true);
  EXPECT_EQ(g2.state_root(), 0);

  // a and b finish the step they were in before they switch: generation
  // 1's step 7, which generation 2 resumes from, is journaled at world 2,
  // and so is step 8 (the plan came after step 7's last bucket).
  EXPECT_TRUE(of<ev::step_completed>().empty());
  const auto stale = js().stale_reports;
  send(step_from("b", 1, 7, 1));
  send(step_from("a", 0, 8, 1));
  send(step_from("b", 1, 8, 1));
  auto steps = of<ev::step_completed>();
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].step, 7);
  EXPECT_EQ(steps[1].step, 8);
  EXPECT_EQ(steps[1].generation, 1u);
  EXPECT_EQ(steps[1].world_size, 2);
  EXPECT_EQ(js().stale_reports, stale);
}

TEST_F(coordinator_actors, a_leaving_node_gets_the_drain_plan_that_excludes_it) {
  start(coord_opts(1));
  send(joined("a", 1));
  send(joined("b", 2));
  advance(100ms);
  wire.clear();
  send(leave_from("b", "SIGTERM"));
  EXPECT_EQ(ms().members.find(node_id{"b"}), nullptr);
  advance(100ms);
  auto to_b = wire.with(pb::envelope::kGenerationPlan, "peer-b");
  ASSERT_EQ(to_b.size(), 1u);
  const auto& p = to_b[0].env.generation_plan();
  expect_plan(p, 2u, 1, "node_left", true);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), 1u);
  auto left = of<ev::node_left>();
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].node, "b");
  EXPECT_EQ(left[0].reason, "SIGTERM");
  EXPECT_TRUE(of<ev::node_lost>().empty());
  EXPECT_EQ(js().world_size, 1);
}

TEST_F(coordinator_actors, after_a_failed_collective_a_silent_node_is_lost_at_the_suspect_timeout) {
  start_two_with_suspect_timeout(300ms);
  ASSERT_EQ(ms().members.state().current->generation, 1u);
  send(heartbeat_from("b", seq++));  // b's last word
  auto silent_from = now();
  keep_alive({"a"}, 50ms);
  send(status_from("a", 0, pb::rank_status::STATE_FAILED, 0));  // an old generation's: ignored
  EXPECT_FALSE(ms().members.suspecting());
  send(status_from("a", 0, pb::rank_status::STATE_FAILED, 1));
  EXPECT_TRUE(ms().members.suspecting());
  keep_alive({"a"}, 400ms);
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_EQ(ms().lost[0].peer.str(), "b");
  EXPECT_GE(ms().lost[0].detected_after_s, 0.3);
  EXPECT_LT(ms().lost[0].detected_after_s, 0.41);
  EXPECT_LT(std::chrono::duration<double>(now() - silent_from).count(), 1.0);  // well before the heartbeat timeout
  auto lost = of<ev::node_lost>();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, ev::loss_cause::suspected_after_collective_failure);
  EXPECT_DOUBLE_EQ(lost[0].detected_after_s, ms().lost[0].detected_after_s);
  expect_plan(last_plan("peer-a"), 2u, 1, "node_lost", false);
}

TEST_F(coordinator_actors, a_failed_collective_with_everyone_alive_restarts_the_generation) {
  start_two_with_suspect_timeout(300ms);
  send(status_from("b", 0, pb::rank_status::STATE_FAILED, 1));
  keep_alive({"a", "b"}, 200ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), 1u);
  keep_alive({"a", "b"}, 200ms);
  EXPECT_TRUE(ms().lost.empty());
  auto g2 = last_plan("peer-a");
  expect_plan(g2, 2u, 2, "collective_failure", false);
  EXPECT_EQ(last_plan("peer-b").generation(), 2u);
  keep_alive({"a", "b"}, 1000ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), 2u);  // once
}

TEST_F(coordinator_actors, a_flapping_node_is_quarantined_then_admitted_again) {
  auto o = coord_opts(1);
  o.membership.flap_max_failures = 2;
  o.membership.quarantine = 10s;
  start(o);
  send(joined("a", 1));
  send(joined("b", 1, 1));
  advance(400ms);             // b's first process fell silent (no heartbeats)...
  send(joined("b", 1, 2));  // ...and it restarted
  auto lost = of<ev::node_lost>();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].cause, ev::loss_cause::restarted);
  EXPECT_EQ(js().nodes_lost, 1u);
  advance(400ms);
  send(joined("b", 1, 3));  // and again
  auto refused = wire.with(pb::envelope::kRegisterAck, "peer-b").back().env.register_ack();
  EXPECT_FALSE(refused.accepted());
  EXPECT_EQ(refused.reason(), "node 'b' is quarantined for 10 s after 2 failures in 60 s (flapping); 10 s left");
  auto q = of<ev::node_quarantined>();
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].node, "b");
  EXPECT_EQ(q[0].reason, "node 'b' is quarantined for 10 s after 2 failures in 60 s (flapping)");
  keep_alive({"a"}, 5000ms);
  EXPECT_EQ(last_plan("peer-a").world_size(), 1);
  send(joined("b", 1, 4));
  EXPECT_FALSE(wire.with(pb::envelope::kRegisterAck, "peer-b").back().env.register_ack().accepted());
  keep_alive({"a"}, 5000ms);
  send(joined("b", 1, 5));
  EXPECT_TRUE(wire.with(pb::envelope::kRegisterAck, "peer-b").back().env.register_ack().accepted());
  EXPECT_EQ(of<ev::node_quarantined>().size(), 1u);
}

TEST_F(coordinator_actors, a_new_coordinator_adopts_the_running_generation_without_a_plan) {
  start(coord_opts(1));
  send(joined_in("b", 1, 5));
  send(joined_in("b", 1, 5));  // said twice (a retry): its slice counts once
  advance(100ms);
  EXPECT_NE(ms().last_reason.find("the nodes of 2 of its 3 ranks have not registered"), std::string::npos) << ms().last_reason;
  send(joined_in("a", 2, 5));  // the last of its members: adopted at once, not at the next tick
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);
  EXPECT_EQ(ms().adopted, 1u);
  const auto& cur = *ms().members.state().current;
  EXPECT_EQ(cur.generation, 5u);
  EXPECT_EQ(ms().members.find(node_id{"a"})->node_rank, 0);
  EXPECT_EQ(js().generation, 5u);
  EXPECT_EQ(js().world_size, 3);
  auto adopted = of<ev::generation_adopted>();
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(adopted[0].generation, 5u);
  EXPECT_EQ(adopted[0].world_size, 3);
  EXPECT_TRUE(of<ev::generation_started>().empty());
  // The job goes on: its reports are of the current generation.
  send(step_from("a", 0, 40, 5));
  send(step_from("a", 1, 40, 5));
  send(step_from("b", 2, 41, 5));
  EXPECT_EQ(js().committed_step, 40);
  EXPECT_EQ(js().stale_reports, 0u);
  keep_alive({"a", "b"}, 500ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);
  EXPECT_EQ(wire.with(pb::envelope::kHeartbeatAck, "peer-a").back().env.generation(), 5u);
}

TEST_F(coordinator_actors, a_new_coordinator_plans_a_restart_when_a_node_of_the_running_generation_is_gone) {
  start(coord_opts(1));  // heartbeat timeout 1 s: adoption waits 2 s
  send(joined_in("a", 2, 5));
  keep_alive({"a"}, 1900ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);
  EXPECT_NE(ms().last_reason.find("to adopt generation 5: the nodes of 1 of its 3 ranks have not registered"), std::string::npos) << ms().last_reason;
  keep_alive({"a"}, 200ms);
  auto p = last_plan("peer-a");
  expect_plan(p, 6u, 2, "restart", false);
  EXPECT_EQ(ms().adopted, 0u);
}

TEST_F(coordinator_actors, events_name_lost_nodes_and_planned_generations) {
  start(coord_opts(1));
  send(joined("a", 1));
  send(joined("b", 1));
  keep_alive({"a", "b"}, 100ms);
  keep_alive({"a"}, 1200ms);
  auto lost = of<ev::node_lost>();
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, ev::loss_cause::heartbeat_timeout);
  EXPECT_GE(lost[0].detected_after_s, 1.0);
  auto planned = of<ev::generation_started>();
  ASSERT_EQ(planned.size(), 2u);
  EXPECT_EQ(planned[0].generation, 1u);
  EXPECT_EQ(planned[0].cause, ev::plan_cause::start);
  EXPECT_EQ(planned[0].world_size, 2);
  EXPECT_EQ(planned[1].generation, 2u);
  EXPECT_EQ(planned[1].cause, ev::plan_cause::node_lost);
  EXPECT_FALSE(planned[1].drain);
  EXPECT_EQ(planned[1].world_size, 1);
  // In order: the loss before the plan it causes.
  auto at = [&](const std::string& kind, uint64_t gen) {
    return std::find_if(events.begin(), events.end(),
                        [&](const ev::event& e) {
                          if (kind == "node_lost") return std::holds_alternative<ev::node_lost>(e);
                          const auto* g = std::get_if<ev::generation_started>(&e);
                          return g && (gen == 0 || g->generation == gen);
                        }) -
           events.begin();
  };
  EXPECT_LT(at("node_lost", 0), at("generation_started", 2));
}

TEST_F(coordinator_actors, the_committed_step_survives_generation_changes) {
  start(coord_opts(1));
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  send(step_from("a", 0, 3, 1));
  send(step_from("b", 1, 4, 1));
  ASSERT_EQ(js().committed_step, 3);
  send(leave_from("b", "SIGTERM"));
  advance(100ms);
  EXPECT_EQ(js().generation, 2u);
  EXPECT_TRUE(js().rank_steps.empty());
  EXPECT_EQ(last_plan("peer-a").start_step(), 3);
  send(step_from("a", 0, 2, 2));  // below the committed step: no going back
  EXPECT_EQ(js().committed_step, 3);
  send(step_from("a", 0, 5, 2));
  EXPECT_EQ(js().committed_step, 5);
}

TEST(coordinator_wire, plans_carry_drain_and_cause_and_read_back_from_a_registration) {
  plan p;
  p.generation = 9;
  p.world_size = 3;
  p.state_root = 1;
  p.drain = true;
  p.cause = plan_cause::node_joined;
  p.nodes = {plan_node{node_id{"b"}, "b.local", "peer-b", 0, 2, 0, 3, {1}}, plan_node{node_id{"a"}, "a.local", "peer-a", 1, 2, 1, 4, {0, 1}}};
  p.ranks = {rank_slot{node_id{"b"}, 1, 0, 1}, rank_slot{node_id{"a"}, 0, 1, 2}, rank_slot{node_id{"a"}, 1, 2, 3}};
  auto wire = to_proto(p, coord_opts(1), 17);
  EXPECT_TRUE(wire.drain());
  EXPECT_EQ(cause_of(wire), plan_cause::node_joined);
  EXPECT_EQ(wire.start_step(), 17);
  // Ranks out of order on the wire are put back in global rank order.
  std::swap(*wire.mutable_ranks(0), *wire.mutable_ranks(2));
  auto back = from_proto(wire);
  EXPECT_EQ(back.generation, 9u);
  EXPECT_EQ(back.world_size, 3);
  EXPECT_EQ(back.state_root, 1);
  EXPECT_TRUE(back.drain);
  EXPECT_EQ(back.cause, plan_cause::node_joined);
  ASSERT_EQ(back.nodes.size(), 2u);
  EXPECT_EQ(back.nodes[0].node_id.str(), "b");
  EXPECT_EQ(back.nodes[0].local_ranks, (std::vector<int32_t>{1}));
  EXPECT_EQ(back.nodes[1].node_id.str(), "a");
  EXPECT_EQ(back.nodes[1].first_global_rank, 1);
  EXPECT_EQ(back.nodes[1].local_ranks, (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(back.ranks.size(), 3u);
  EXPECT_EQ(back.ranks[0].node_id.str(), "b");
  EXPECT_EQ(back.ranks[0].local_rank, 1);
  EXPECT_EQ(back.ranks[2].global_rank, 2);
}

// Every plan names the checkpoint a generation falls back to when state is
// lost although ranks survive (ZeRO: both holders of a shard lost): the
// newest committed one no rank refused. The plan, not a rank, picks it.
TEST(coordinator_wire, every_plan_names_the_checkpoint_to_fall_back_to) {
  plan p;
  p.generation = 4;
  p.world_size = 1;
  p.state_root = 0;
  p.nodes = {plan_node{node_id{"a"}, "a.local", "peer-a", 0, 1, 0, 1, {0}}};
  p.ranks = {rank_slot{node_id{"a"}, 0, 0, 1}};
  checkpoint_ledger l;
  l.committed = {10, 20, 30};
  l.bad = {30};
  auto wire = to_proto(p, coord_opts(1), 25, l);
  EXPECT_EQ(wire.state_root(), 0);
  EXPECT_EQ(wire.checkpoint_step(), -1) << "a survivor holds the state";
  ASSERT_TRUE(wire.has_fallback_checkpoint_step());
  EXPECT_EQ(wire.fallback_checkpoint_step(), 20);
  EXPECT_FALSE(to_proto(p, coord_opts(1), 25, {}).has_fallback_checkpoint_step()) << "none committed: none named";
  p.state_root = -1;
  wire = to_proto(p, coord_opts(1), 25, l);
  EXPECT_EQ(wire.state_root(), 0);
  EXPECT_EQ(wire.checkpoint_step(), 20);
  EXPECT_EQ(wire.fallback_checkpoint_step(), 20);
}

// -- the job actor's end, stop, failure, recovery and checkpoints -------------
