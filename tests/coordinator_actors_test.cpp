// The coordinator's membership and job actors under CAF's deterministic test
// coordinator: no sleeps, the clock moves only in advance().
#include "actors/coordinator_actors.hpp"

#include <gtest/gtest.h>

#include "actor_test_util.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

coordinator_options coord_opts(int32_t min_nodes, int32_t max_nodes = 64) {
  coordinator_options o;
  o.membership.min_nodes = min_nodes;
  o.membership.max_nodes = max_nodes;
  o.liveness = liveness_options{100ms, 1000ms};
  o.header = envelope_header{1, "job", "coordinator", 1};
  o.store_host = "coord.local";
  o.store_port = 29500;
  return o;
}

// register_node of a node whose ranks are all up and warmed.
inbound joined(const std::string& node_id, int32_t nproc, uint64_t incarnation = 1) {
  auto in = register_from(node_id, nproc, incarnation);
  for (int32_t l = 0; l < nproc; ++l) in.env.mutable_register_node()->add_ready_ranks(l);
  return in;
}

inbound step_from(const std::string& node_id, int32_t global_rank, int64_t step, uint64_t generation) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  in.env.mutable_step_report()->set_step(step);
  in.env.mutable_step_report()->set_global_rank(global_rank);
  return in;
}

}  // namespace

class coordinator_actors : public ::testing::Test, public caf_fixture {
 protected:
  void start(coordinator_options o, int64_t max_steps = 100) {
    job_options jo;
    jo.max_steps = max_steps;
    jo.header = o.header;
    jo.on_finished = [this](int64_t step, const std::string& reason) {
      finished_step = step;
      finished_reason = reason;
    };
    job = spawn(job_actor, jo, wire.sink());
    members = spawn(membership_actor, o, wire.sink(), job);
    run();
  }

  void send(const inbound& in) {
    caf::anon_send(members, in);
    run();
  }

  membership_actor_state& ms() { return state_of<membership_actor_state>(members); }
  job_actor_state& js() { return state_of<job_actor_state>(job); }

  wire_log wire;
  caf::actor job;
  caf::actor members;
  int64_t finished_step = -1;
  std::string finished_reason;
};

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
    ASSERT_EQ(p.ranks_size(), 4);
    EXPECT_EQ(p.ranks(1).node_id(), "a");
    EXPECT_EQ(p.ranks(1).global_rank(), 1);
    EXPECT_EQ(p.ranks(2).node_id(), "b");
    EXPECT_EQ(p.ranks(2).local_rank(), 0);
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
  EXPECT_EQ(cur.nodes[1].node_id, "b");
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

// Mesos partition-test shape: b stops heartbeating (its messages are dropped),
// the clock moves past the timeout, b is removed and a plans without it.
TEST_F(coordinator_actors, a_silent_node_is_declared_lost_and_a_new_generation_excludes_it) {
  start(coord_opts(1));
  send(joined("a", 2));
  send(joined("b", 2));
  advance(100ms);
  ASSERT_EQ(ms().members.state().current->generation, 1u);
  wire.clear();
  auto partitioned_at = now();
  for (int i = 0; i < 12; ++i) {
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_EQ(ms().lost[0].peer, "b");
  EXPECT_GE(ms().lost[0].detected_after_s, 1.0);
  EXPECT_LE(ms().lost[0].detected_after_s, std::chrono::duration<double>(now() - partitioned_at).count());
  EXPECT_EQ(ms().members.find("b"), nullptr);
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
  start(coord_opts(2), 5);
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

  // b is lost; generation 2 resumes from the committed step.
  for (int i = 0; i < 11; ++i) {
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  auto plans = wire.with(pb::envelope::kGenerationPlan, "peer-a");
  ASSERT_EQ(plans.size(), 1u);  // generation 1 only: with min_nodes = 2, a alone is below quorum
  EXPECT_NE(ms().last_reason.find("generation 1 is below quorum"), std::string::npos) << ms().last_reason;
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
  EXPECT_FALSE(js().finished);  // rank 0 still evaluates and checkpoints
  inbound done{links::nodes, "peer-a", node_envelope("a", 1, 2)};
  done.env.mutable_rank_status()->set_status(pb::rank_status::STATE_FINISHED);
  done.env.mutable_rank_status()->set_global_rank(0);
  done.env.mutable_rank_status()->set_step(5);
  send(done);
  EXPECT_TRUE(js().finished);
  EXPECT_EQ(finished_step, 5);
  EXPECT_EQ(finished_reason, "reached train.max_steps = 5");
  auto bye = wire.with(pb::envelope::kShutdown);
  ASSERT_EQ(bye.size(), 1u);
  EXPECT_EQ(bye[0].peer, "peer-a");
  EXPECT_EQ(bye[0].env.shutdown().reason(), "reached train.max_steps = 5");
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
  EXPECT_TRUE(js().finished);
  EXPECT_EQ(finished_step, 40);
  EXPECT_EQ(finished_reason, "every rank of generation 1 reported finished");
}

TEST_F(coordinator_actors, without_a_job_actor_plans_start_at_step_0) {
  auto o = coord_opts(1);
  members = spawn(membership_actor, o, wire.sink(), caf::actor{});
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
