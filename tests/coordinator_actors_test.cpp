// The coordinator's membership actor: registration, silence, standbys and
// the job's committed steps (tests/coordinator_actors_fixture.hpp).
#include <gtest/gtest.h>

#include "coordinator_actors_fixture.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace dtactor::coordinator_test;
using namespace std::chrono_literals;

TEST_F(coordinator_actors, two_nodes_are_acked_with_ranks_0_and_1_and_get_one_plan) {
  start(coord_opts(2));
  send(joined("a", 2));
  send(joined("b", 2));
  auto acks = wire.with(pb::envelope::kRegisterAck);
  ASSERT_EQ(acks.size(), 2u);
  EXPECT_EQ(acks[0].peer, "peer-a");
  EXPECT_TRUE(acks[0].env.register_ack().accepted());
  EXPECT_EQ(acks[0].env.register_ack().node_rank(), 0);
  EXPECT_EQ(acks[1].peer, "peer-b");
  EXPECT_EQ(acks[1].env.register_ack().node_rank(), 1);
  EXPECT_EQ(acks[1].env.register_ack().job_id(), "job");
  EXPECT_EQ(acks[1].env.sender(), "coordinator");
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);  // plans are made on the tick

  advance(100ms);
  auto plans = wire.with(pb::envelope::kGenerationPlan);
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[0].peer, "peer-a");
  EXPECT_EQ(plans[1].peer, "peer-b");
  for (const auto& s : plans) {
    EXPECT_EQ(s.link, links::nodes);
    EXPECT_EQ(s.env.generation(), 1u);
    const auto& p = s.env.generation_plan();
    EXPECT_EQ(p.generation(), 1u);
    EXPECT_EQ(p.world_size(), 4);
    EXPECT_EQ(p.store_host(), "coord.local");
    EXPECT_EQ(p.store_port(), 29500);
    EXPECT_EQ(p.start_step(), 0);
    EXPECT_EQ(p.state_root(), -1);
    // Each node gets its own ranks and the layout (2 ranks on a, 2 on b):
    // one run of 2 nodes holding 2 ranks each.
    EXPECT_EQ(std::vector<int32_t>(p.node_rank_runs().begin(), p.node_rank_runs().end()), (std::vector<int32_t>{2, 2}));
    EXPECT_EQ(node_rank_counts(p, 4), (std::vector<int32_t>{2, 2}));
    ASSERT_EQ(p.ranks_size(), 2);
    const std::string mine = s.peer == "peer-a" ? "a" : "b";
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(p.ranks(i).node_id(), mine);
      EXPECT_EQ(p.ranks(i).local_rank(), i);
      EXPECT_EQ(p.ranks(i).global_rank(), (mine == "a" ? 0 : 2) + i);
      EXPECT_EQ(p.ranks(i).host_ranks(), 2);  // each node on an address of its own
    }
  }
  EXPECT_EQ(js().generation, 1u);
  EXPECT_EQ(js().world_size, 4);

  // Heartbeats keep both in; no further plans.
  for (int i = 0; i < 20; ++i) {
    send(heartbeat_from("a", i));
    send(heartbeat_from("b", i));
    advance(100ms);
  }
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 2u);
  EXPECT_EQ(wire.count(pb::envelope::kHeartbeatAck, "peer-a"), 20u);
  EXPECT_EQ(wire.with(pb::envelope::kHeartbeatAck, "peer-b").back().env.heartbeat_ack().seq(), 19u);
}

// A member whose plan was lost (its beats still say generation 0) gets its
// own slice again a quarter of the timeout after the plan went out, then at
// most every quarter timeout, until its beats say the plan's generation.
TEST_F(coordinator_actors, a_member_whose_beats_say_an_older_generation_gets_its_plan_again) {
  std::vector<std::string> lines;
  auto o = coord_opts(2);
  o.log = [&lines](const std::string& l) { lines.push_back(l); };
  start(o);
  beats_follow_plans = false;
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  ASSERT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-b"), 1u);
  const auto first = last_plan("peer-b");
  for (uint64_t i = 0; i < 10; ++i) {  // 1 s: a has its plan, b does not
    auto a = heartbeat_from("a", i);
    a.env.set_generation(1);
    send(a);
    send(heartbeat_from("b", i));
    advance(100ms);
  }
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), 1u);
  const auto again = wire.with(pb::envelope::kGenerationPlan, "peer-b");
  ASSERT_EQ(again.size(), 4u);  // at 300, 600 and 900 ms after the plan (beats every 100 ms, 250 ms apart at least)
  EXPECT_EQ(again.back().env.generation_plan().SerializeAsString(), first.SerializeAsString());
  EXPECT_EQ(ms().plans_resent, 3u);
  EXPECT_EQ(std::count_if(lines.begin(), lines.end(), [](const std::string& l) { return l.find("its plan is sent again") != std::string::npos; }), 1);
  for (uint64_t i = 10; i < 20; ++i) {  // b got it
    for (const std::string id : {"a", "b"}) {
      auto hb = heartbeat_from(id, i);
      hb.env.set_generation(1);
      send(hb);
    }
    advance(100ms);
  }
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-b"), 4u);
}

// A beat that asks for no answer keeps its node in and gets none; one that
// asks is answered, with no interval override at this size.
TEST_F(coordinator_actors, a_heartbeat_without_an_ack_wanted_keeps_the_node_in_unanswered) {
  start(coord_opts(1));
  send(joined("a", 1));
  advance(100ms);
  const auto acks = wire.count(pb::envelope::kHeartbeatAck, "peer-a");
  for (uint64_t i = 0; i < 30; ++i) {
    auto hb = heartbeat_from("a", i);
    hb.env.mutable_heartbeat()->set_no_ack(i % 3 != 0);
    send(hb);
    advance(100ms);
  }
  EXPECT_EQ(wire.count(pb::envelope::kHeartbeatAck, "peer-a") - acks, 10u);
  EXPECT_EQ(wire.with(pb::envelope::kHeartbeatAck, "peer-a").back().env.heartbeat_ack().interval_ms(), 0u);
  EXPECT_EQ(ms().members.state().nodes.count(node_id{"a"}), 1u);  // 3 s of beats: still a member
}

// Past the heartbeat budget (10,000 beats a second) the coordinator asks
// its nodes for a longer interval, from registration on and in its acks.
TEST_F(coordinator_actors, many_nodes_are_asked_to_beat_less_often) {
  start(coord_opts(1, 3000));
  for (int i = 0; i < 2500; ++i) send(joined("n" + std::to_string(i), 1));
  const auto acks = wire.with(pb::envelope::kRegisterAck);
  ASSERT_EQ(acks.size(), 2500u);
  EXPECT_EQ(acks.front().env.register_ack().heartbeat_interval_ms(), 0u);  // alone: as configured
  EXPECT_EQ(acks[1999].env.register_ack().heartbeat_interval_ms(), 200u);  // the 2,000th: 2,000 x 5 a second
  EXPECT_EQ(acks.back().env.register_ack().heartbeat_interval_ms(), 250u);  // capped at a quarter of the timeout
  send(heartbeat_from("n7", 1));
  EXPECT_EQ(wire.with(pb::envelope::kHeartbeatAck, "peer-n7").back().env.heartbeat_ack().interval_ms(), 250u);
}

// A coordinator of a pair (opts.orphaned set) that loses every node to
// silence and then hears from none for orphan_after is cut off from them:
// it says so once, for its lease to go to the standby they can reach.
TEST_F(coordinator_actors, a_coordinator_that_lost_every_node_to_silence_is_orphaned_once) {
  std::vector<std::string> said;
  start_a_pair_member_with_a_and_b(said);
  const auto cut = now();
  advance(1500ms);  // both lost (silent past the 1 s timeout), not yet orphaned
  ASSERT_TRUE(ms().members.state().nodes.empty());
  EXPECT_TRUE(said.empty());
  advance(600ms);
  ASSERT_EQ(said.size(), 1u);
  EXPECT_NE(said[0].find("every node was lost to silence"), std::string::npos) << said[0];
  EXPECT_GE(std::chrono::duration<double>(now() - cut).count(), 2.0);
  advance(3000ms);
  EXPECT_EQ(said.size(), 1u);  // once
}

// Nodes whose processes ended (their connections closed), or that left,
// are gone, not out of reach: no standby could reach them either.
TEST_F(coordinator_actors, a_coordinator_whose_nodes_closed_or_left_is_not_orphaned) {
  std::vector<std::string> said;
  start_a_pair_member_with_a_and_b(said);
  caf::anon_send(members, closed_atom::value, std::string("peer-a"));
  send(leave_from("b", "SIGTERM"));
  advance(5000ms);
  ASSERT_TRUE(ms().members.state().nodes.empty());
  EXPECT_TRUE(said.empty());
}

TEST_F(coordinator_actors, a_node_that_registers_again_gets_its_old_rank) {
  start(coord_opts(1));
  send(joined("a", 1));
  send(joined("b", 1));
  send(joined("c", 1));
  advance(100ms);
  // b leaves (preempted), a newcomer arrives, then b comes back as a new process.
  inbound leave{links::nodes, "peer-b", node_envelope("b", 1)};
  leave.env.mutable_leave()->set_reason("SIGTERM");
  send(leave);
  send(joined("d", 1));
  advance(100ms);
  trained();
  send(joined("b", 1, 2));
  auto acks = wire.with(pb::envelope::kRegisterAck);
  ASSERT_EQ(acks.size(), 5u);
  EXPECT_EQ(acks[3].env.register_ack().node_rank(), 3);  // d: b's rank is kept for b
  EXPECT_EQ(acks[4].peer, "peer-b");
  EXPECT_EQ(acks[4].env.register_ack().node_rank(), 1);
  advance(100ms);
  const auto& cur = *ms().members.state().current;
  EXPECT_EQ(cur.generation, 3u);
  EXPECT_EQ(cur.world_size, 4);
  EXPECT_EQ(cur.nodes[1].node_id.str(), "b");
  EXPECT_EQ(cur.state_root, 0);
}

TEST_F(coordinator_actors, refuses_nodes_beyond_max_nodes) {
  start(coord_opts(1, 2));
  send(joined("a", 1));
  send(joined("b", 1));
  send(joined("c", 1));
  auto refused = wire.with(pb::envelope::kRegisterAck, "peer-c");
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_FALSE(refused[0].env.register_ack().accepted());
  EXPECT_NE(refused[0].env.register_ack().reason().find("cluster.max_nodes is 2"), std::string::npos);
  advance(100ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-c"), 0u);
  EXPECT_EQ(ms().members.state().current->world_size, 2);
}

// cluster.standby_nodes = 1 at max_nodes 2: c is admitted and waits outside
// (no plan reaches it); when b falls silent, the tick that declares it lost
// plans c in at once, settling or not: one generation at world 2 with c,
// never one at world 1, and generation_started names the promoted standby.
TEST_F(coordinator_actors, a_standby_node_waits_outside_and_takes_a_lost_members_place_in_one_plan) {
  auto o = coord_opts(2, 2);
  o.membership.standby_nodes = 1;
  o.membership.settle = 600s;
  start(o);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  ASSERT_EQ(ms().members.state().current->generation, 1u);
  trained();
  send(joined("c", 1));
  auto acked = wire.with(pb::envelope::kRegisterAck, "peer-c");
  ASSERT_EQ(acked.size(), 1u);
  EXPECT_TRUE(acked[0].env.register_ack().accepted()) << acked[0].env.register_ack().reason();
  keep_alive({"a", "b", "c"}, 500ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-c"), 0u);
  EXPECT_EQ(ms().members.state().current->generation, 1u);
  wire.clear();
  keep_alive({"a", "c"}, 1200ms);  // b silent past the heartbeat timeout
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_EQ(ms().lost[0].peer.str(), "b");
  auto plans = wire.with(pb::envelope::kGenerationPlan);
  ASSERT_EQ(plans.size(), 2u);  // one generation, to a and c
  for (const auto& p : plans) expect_plan(p.env.generation_plan(), 2, 2, "node_lost", false);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-c"), 1u);
  auto started = of<ev::generation_started>();
  ASSERT_EQ(started.size(), 2u);
  EXPECT_EQ(started[1].nodes, (std::vector<std::string>{"a", "c"}));
  ASSERT_TRUE(started[1].standby_promoted);
  EXPECT_EQ(*started[1].standby_promoted, std::vector<std::string>{"c"});
  EXPECT_FALSE(started[0].standby_promoted);
}

// Mesos partition-test shape: b stops heartbeating (its messages are dropped),
// the clock moves past the timeout, b is removed and a plans without it.
TEST_F(coordinator_actors, a_silent_node_is_declared_lost_and_a_new_generation_excludes_it) {
  start(coord_opts(1));
  send(joined("a", 2));
  send(joined("b", 2));
  advance(100ms);
  ASSERT_EQ(ms().members.state().current->generation, 1u);
  trained();
  wire.clear();
  auto partitioned_at = now();
  for (int i = 0; i < 12; ++i) {
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_EQ(ms().lost[0].peer.str(), "b");
  EXPECT_GE(ms().lost[0].detected_after_s, 1.0);
  EXPECT_LE(ms().lost[0].detected_after_s, std::chrono::duration<double>(now() - partitioned_at).count());
  EXPECT_EQ(ms().members.find(node_id{"b"}), nullptr);
  EXPECT_EQ(js().nodes_lost, 1u);

  auto plans = wire.with(pb::envelope::kGenerationPlan);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].peer, "peer-a");
  EXPECT_EQ(plans[0].env.generation_plan().generation(), 2u);
  EXPECT_EQ(plans[0].env.generation_plan().world_size(), 2);
  EXPECT_EQ(plans[0].env.generation_plan().state_root(), 0);

  // When the partition heals, b's heartbeat is answered with "register again".
  send(heartbeat_from("b", 99));
  auto told = wire.with(pb::envelope::kRegisterAck, "peer-b");
  ASSERT_EQ(told.size(), 1u);
  EXPECT_FALSE(told[0].env.register_ack().accepted());
  EXPECT_NE(told[0].env.register_ack().reason().find("register again"), std::string::npos);
  EXPECT_EQ(ms().refused_heartbeats, 1u);
}

// The coordinator's own stall (its process descheduled 1.4 s on a machine
// loaded past its cores): the nodes' heartbeats of that time wait in its
// mailbox behind the late tick. Nobody is declared lost for it; a node that
// stays silent afterwards still is, a timeout of awake time later.
TEST_F(coordinator_actors, a_stall_of_the_coordinator_declares_nobody_lost_and_real_silence_still_is) {
  start(coord_opts(1));
  send(joined("a", 1));
  send(joined("b", 1));
  keep_alive({"a", "b"}, 300ms);
  ASSERT_EQ(ms().members.state().current->generation, 1u);
  trained();
  // The stall: the clock jumps 1.4 s with no tick run; the heartbeats sent
  // meanwhile are in the mailbox when the late tick comes.
  sched.clock().advance_time(1400ms);
  caf::anon_send(members, heartbeat_from("a", seq++));
  caf::anon_send(members, heartbeat_from("b", seq++));
  run();
  EXPECT_TRUE(ms().lost.empty()) << "a stall of the coordinator declared " << ms().lost.size() << " node(s) lost";
  EXPECT_EQ(ms().members.state().current->generation, 1u);
  EXPECT_GE(ms().pauses.longest(), 1200ms);
  // b then falls silent for real: lost after the timeout.
  const auto silent_from = now();
  keep_alive({"a"}, 1200ms);
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_EQ(ms().lost[0].peer.str(), "b");
  EXPECT_LE(ms().lost[0].detected_after_s, std::chrono::duration<double>(now() - silent_from).count() + 0.2);
}

TEST_F(coordinator_actors, below_min_nodes_no_plan_and_the_reason_says_why) {
  std::vector<std::string> log;
  auto o = coord_opts(2);
  o.log = [&log](const std::string& l) { log.push_back(l); };
  start(o);
  send(joined("a", 1));
  advance(300ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);
  EXPECT_EQ(ms().last_reason, "waiting for 2 nodes (cluster.min_nodes), have 1 [a]");
  // Logged once per change of reason, not per tick.
  EXPECT_EQ(std::count(log.begin(), log.end(), ms().last_reason), 1);
}

TEST_F(coordinator_actors, job_commits_steps_and_fences_old_generations) {
  auto o = coord_opts(2);
  o.membership.floor_nodes = 2;  // this job never trains on one node
  start(o, 5);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  send(step_from("a", 0, 3, 1));
  EXPECT_EQ(js().committed_step, 0);  // b has not reported
  send(step_from("b", 1, 2, 1));
  EXPECT_EQ(js().committed_step, 2);
  send(step_from("b", 1, 4, 0));  // generation 0: fenced
  EXPECT_EQ(js().stale_reports, 1u);
  EXPECT_EQ(js().committed_step, 2);
  send(step_from("b", 1, 7, 1));  // b overtakes a: the lowest is a's 3
  EXPECT_EQ(js().committed_step, 3);
  send(step_from("a", 0, 1, 1));  // an older report of a changes nothing
  EXPECT_EQ(js().committed_step, 3);
  send(step_from("a", 0, 9, 1));
  EXPECT_EQ(js().committed_step, 7);

  // b is lost; generation 2 resumes from the committed step.
  for (int i = 0; i < 11; ++i) {
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  auto plans = wire.with(pb::envelope::kGenerationPlan, "peer-a");
  ASSERT_EQ(plans.size(), 1u);  // generation 1 only: with floor_nodes = 2, a alone waits
  EXPECT_NE(ms().last_reason.find("below the floor of 2 (cluster.floor_nodes)"), std::string::npos) << ms().last_reason;
  // Journaled once (not per tick) that the job waits below its floor.
  EXPECT_EQ(of<ev::job_waiting>().size(), 1u) << ms().last_reason;
}

// min_nodes is the start gate only: a job that waited for two nodes goes on
// alone when one is lost (the floor defaults to 1).
TEST_F(coordinator_actors, a_job_that_waited_for_two_nodes_goes_on_with_one) {
  start(coord_opts(2), 100);
  send(joined("a", 1));
  advance(100ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);  // the start gate holds
  send(joined("b", 1));
  advance(100ms);
  ASSERT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), 1u);
  for (int i = 0; i < 12; ++i) {  // b falls silent past the heartbeat timeout
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  auto plans = wire.with(pb::envelope::kGenerationPlan, "peer-a");
  ASSERT_EQ(plans.size(), 2u) << ms().last_reason;
  EXPECT_EQ(plans.back().env.generation_plan().world_size(), 1);
  EXPECT_EQ(cause_of(plans.back().env.generation_plan()), plan_cause::node_lost);
}

TEST_F(coordinator_actors, job_finishes_at_max_steps_and_shuts_down_every_node) {
  start(coord_opts(1), 5);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  send(step_from("a", 0, 3, 1));
  send(step_from("b", 1, 3, 1));
  EXPECT_EQ(js().committed_step, 3);
  // b is lost: generation 2 with a alone starts from step 3.
  for (int i = 0; i < 11; ++i) {
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  auto plans = wire.with(pb::envelope::kGenerationPlan, "peer-a");
  ASSERT_EQ(plans.size(), 2u);
  EXPECT_EQ(plans[1].env.generation_plan().generation(), 2u);
  EXPECT_EQ(plans[1].env.generation_plan().start_step(), 3);
  send(step_from("a", 0, 5, 2));
  EXPECT_FALSE(js().ending);  // rank 0 still evaluates and checkpoints
  inbound done{links::nodes, "peer-a", node_envelope("a", 1, 2)};
  done.env.mutable_rank_status()->set_status(pb::rank_status::STATE_FINISHED);
  done.env.mutable_rank_status()->set_global_rank(0);
  done.env.mutable_rank_status()->set_step(5);
  send(done);
  EXPECT_TRUE(js().ended);
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::finished);
  EXPECT_EQ(end[0].step, 5);
  EXPECT_EQ(end[0].exit_code, 0);
  // Every node that registered is told, b too (it may be alive but cut off).
  auto bye = wire.with(pb::envelope::kShutdown);
  ASSERT_EQ(bye.size(), 2u);
  EXPECT_EQ(bye[0].peer, "peer-a");
  EXPECT_EQ(bye[1].peer, "peer-b");
  EXPECT_EQ(bye[0].env.shutdown().reason(), "job finished");
  EXPECT_FALSE(bye[0].env.shutdown().checkpoint());
}

TEST_F(coordinator_actors, job_finishes_when_every_rank_reports_finished) {
  start(coord_opts(1), 1000);
  send(joined("a", 2));
  advance(100ms);
  for (int32_t g = 0; g < 2; ++g) {
    inbound in{links::nodes, "peer-a", node_envelope("a", 1, 1)};
    in.env.mutable_rank_status()->set_status(pb::rank_status::STATE_FINISHED);
    in.env.mutable_rank_status()->set_global_rank(g);
    in.env.mutable_rank_status()->set_step(40);
    send(in);
  }
  EXPECT_TRUE(js().ended);
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::stopped);  // below train.max_steps
  EXPECT_EQ(end[0].step, 40);
  EXPECT_EQ(end[0].world_size, 2);
}
