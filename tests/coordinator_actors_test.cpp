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

inbound status_from(const std::string& node_id, int32_t local_rank, pb::rank_status::state state, uint64_t generation = 0, uint64_t incarnation = 1) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, incarnation, generation)};
  in.env.mutable_rank_status()->set_local_rank(local_rank);
  in.env.mutable_rank_status()->set_status(state);
  return in;
}

inbound leave_from(const std::string& node_id, const std::string& reason, uint64_t incarnation = 1) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, incarnation)};
  in.env.mutable_leave()->set_reason(reason);
  return in;
}

// Generation `g` as nodes report it after a coordinator restart: a's two ranks, then b's one.
pb::generation_plan running_plan(uint64_t g) {
  pb::generation_plan p;
  p.set_generation(g);
  p.set_world_size(3);
  p.set_state_root(0);
  const std::vector<std::pair<std::string, int32_t>> slots{{"a", 0}, {"a", 1}, {"b", 0}};
  for (int32_t r = 0; r < 3; ++r) {
    auto* a = p.add_ranks();
    a->set_node_id(slots[r].first);
    a->set_local_rank(slots[r].second);
    a->set_global_rank(r);
  }
  return p;
}

inbound joined_in(const std::string& node_id, int32_t nproc, uint64_t g) {
  auto in = joined(node_id, nproc);
  *in.env.mutable_register_node()->mutable_current_plan() = running_plan(g);
  in.env.mutable_register_node()->set_last_generation(g);
  in.env.set_generation(g);
  return in;
}

void expect_plan(const pb::generation_plan& p, uint64_t generation, int32_t world_size, const std::string& cause, bool drain) {
  EXPECT_EQ(p.generation(), generation);
  EXPECT_EQ(p.world_size(), world_size);
  EXPECT_EQ(p.cause(), cause);
  EXPECT_EQ(p.drain(), drain);
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
    if (!o.on_event) o.on_event = [this](const cluster_event& ev) { events.push_back(ev); };
    job = spawn(job_actor, jo, wire.sink());
    members = spawn(membership_actor, o, wire.sink(), job);
    run();
  }

  // a and b (one rank each) in generation 1, heartbeating.
  void start_two_with_suspect_timeout(std::chrono::milliseconds suspect) {
    auto o = coord_opts(1);
    o.liveness.suspect_timeout = suspect;
    o.membership.suspect_timeout = suspect;
    start(o);
    send(joined("a", 1));
    send(joined("b", 1));
    keep_alive({"a", "b"}, 200ms);
  }

  // Events of this kind, in order.
  std::vector<cluster_event> of(const std::string& kind) const {
    std::vector<cluster_event> out;
    for (const auto& e : events)
      if (e.kind == kind) out.push_back(e);
    return out;
  }

  // Heartbeats from `ids` every 100 ms for `total`.
  void keep_alive(std::initializer_list<std::string> ids, std::chrono::milliseconds total) {
    for (auto done = 0ms; done < total; done += 100ms) {
      for (const auto& id : ids) send(heartbeat_from(id, seq++));
      advance(std::min(100ms, total - done));
    }
  }

  pb::generation_plan last_plan(const std::string& peer) { return wire.with(pb::envelope::kGenerationPlan, peer).back().env.generation_plan(); }

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
  std::vector<cluster_event> events;
  uint64_t seq = 0;
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
  auto o = coord_opts(2);
  o.membership.floor_nodes = 2;  // this job never trains on one node
  std::vector<cluster_event> events;
  o.on_event = [&events](const cluster_event& e) { events.push_back(e); };
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

  // b is lost; generation 2 resumes from the committed step.
  for (int i = 0; i < 11; ++i) {
    send(heartbeat_from("a", i));
    advance(100ms);
  }
  auto plans = wire.with(pb::envelope::kGenerationPlan, "peer-a");
  ASSERT_EQ(plans.size(), 1u);  // generation 1 only: with floor_nodes = 2, a alone waits
  EXPECT_NE(ms().last_reason.find("below the floor of 2 (cluster.floor_nodes)"), std::string::npos) << ms().last_reason;
  // Journaled once (not per tick) that the job waits below its floor.
  auto waiting = std::count_if(events.begin(), events.end(), [](const cluster_event& e) { return e.kind == "job_waiting"; });
  EXPECT_EQ(waiting, 1) << ms().last_reason;
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
  EXPECT_EQ(plans.back().env.generation_plan().cause(), "node_lost");
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
  EXPECT_EQ(g1.cause(), "start");
  EXPECT_FALSE(g1.drain());
  // The agent may also pass a rank's own envelope on.
  inbound relayed = status_from("a", 0, pb::rank_status::STATE_IDLE);
  relayed.env.set_sender("rank/a/0");
  relayed.env.set_incarnation(77);
  send(relayed);
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
  auto planned = of("generation_planned");
  ASSERT_EQ(planned.size(), 3u);
  EXPECT_EQ(planned[2].cause, "rank_exited");
  EXPECT_EQ(planned[1].world_size, 2);
  EXPECT_TRUE(planned[1].drain);
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
  EXPECT_EQ(of("node_joined").size(), 2u);
  EXPECT_EQ(of("node_joined")[1].node, "b");

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
}

TEST_F(coordinator_actors, a_leaving_node_gets_the_drain_plan_that_excludes_it) {
  start(coord_opts(1));
  send(joined("a", 1));
  send(joined("b", 2));
  advance(100ms);
  wire.clear();
  send(leave_from("b", "SIGTERM"));
  EXPECT_EQ(ms().members.find("b"), nullptr);
  advance(100ms);
  auto to_b = wire.with(pb::envelope::kGenerationPlan, "peer-b");
  ASSERT_EQ(to_b.size(), 1u);
  const auto& p = to_b[0].env.generation_plan();
  expect_plan(p, 2u, 1, "node_left", true);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), 1u);
  auto left = of("node_left");
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].node, "b");
  EXPECT_EQ(left[0].detail, "SIGTERM");
  EXPECT_TRUE(of("node_lost").empty());
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
  EXPECT_EQ(ms().lost[0].peer, "b");
  EXPECT_GE(ms().lost[0].detected_after_s, 0.3);
  EXPECT_LT(ms().lost[0].detected_after_s, 0.41);
  EXPECT_LT(std::chrono::duration<double>(now() - silent_from).count(), 1.0);  // well before the heartbeat timeout
  auto lost = of("node_lost");
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, "suspected_after_collective_failure");
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
  auto lost = of("node_lost");
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].cause, "restarted");
  EXPECT_EQ(js().nodes_lost, 1u);
  advance(400ms);
  send(joined("b", 1, 3));  // and again
  auto refused = wire.with(pb::envelope::kRegisterAck, "peer-b").back().env.register_ack();
  EXPECT_FALSE(refused.accepted());
  EXPECT_EQ(refused.reason(), "node 'b' is quarantined for 10 s after 2 failures in 60 s (flapping); 10 s left");
  auto q = of("node_quarantined");
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].node, "b");
  EXPECT_EQ(q[0].detail, "node 'b' is quarantined for 10 s after 2 failures in 60 s (flapping)");
  keep_alive({"a"}, 5000ms);
  EXPECT_EQ(last_plan("peer-a").world_size(), 1);
  send(joined("b", 1, 4));
  EXPECT_FALSE(wire.with(pb::envelope::kRegisterAck, "peer-b").back().env.register_ack().accepted());
  keep_alive({"a"}, 5000ms);
  send(joined("b", 1, 5));
  EXPECT_TRUE(wire.with(pb::envelope::kRegisterAck, "peer-b").back().env.register_ack().accepted());
  EXPECT_EQ(of("node_quarantined").size(), 1u);
}

TEST_F(coordinator_actors, a_new_coordinator_adopts_the_running_generation_without_a_plan) {
  start(coord_opts(1));
  send(joined_in("b", 1, 5));
  send(joined_in("a", 2, 5));
  advance(100ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u);
  EXPECT_EQ(ms().adopted, 1u);
  const auto& cur = *ms().members.state().current;
  EXPECT_EQ(cur.generation, 5u);
  EXPECT_EQ(ms().members.find("a")->node_rank, 0);
  EXPECT_EQ(js().generation, 5u);
  EXPECT_EQ(js().world_size, 3);
  auto adopted = of("generation_adopted");
  ASSERT_EQ(adopted.size(), 1u);
  EXPECT_EQ(adopted[0].generation, 5u);
  EXPECT_EQ(adopted[0].world_size, 3);
  EXPECT_TRUE(of("generation_planned").empty());
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
  EXPECT_NE(ms().last_reason.find("to adopt generation 5: node 'b' has not registered"), std::string::npos) << ms().last_reason;
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
  auto lost = of("node_lost");
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, "heartbeat_timeout");
  EXPECT_GE(lost[0].detected_after_s, 1.0);
  auto planned = of("generation_planned");
  ASSERT_EQ(planned.size(), 2u);
  EXPECT_EQ(planned[0].generation, 1u);
  EXPECT_EQ(planned[0].cause, "start");
  EXPECT_EQ(planned[0].world_size, 2);
  EXPECT_EQ(planned[1].generation, 2u);
  EXPECT_EQ(planned[1].cause, "node_lost");
  EXPECT_FALSE(planned[1].drain);
  EXPECT_EQ(planned[1].world_size, 1);
  // In order: the loss before the plan it causes.
  auto at = [&](const std::string& kind, uint64_t gen) {
    return std::find_if(events.begin(), events.end(), [&](const cluster_event& e) { return e.kind == kind && (gen == 0 || e.generation == gen); }) -
           events.begin();
  };
  EXPECT_LT(at("node_lost", 0), at("generation_planned", 2));
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
  p.cause = "node_joined";
  p.nodes = {plan_node{"b", "b.local", "peer-b", 0, 2, 0, 3, {1}}, plan_node{"a", "a.local", "peer-a", 1, 2, 1, 4, {0, 1}}};
  p.ranks = {rank_slot{"b", 1, 0, 1}, rank_slot{"a", 0, 1, 2}, rank_slot{"a", 1, 2, 3}};
  auto wire = to_proto(p, coord_opts(1), 17);
  EXPECT_TRUE(wire.drain());
  EXPECT_EQ(wire.cause(), "node_joined");
  EXPECT_EQ(wire.start_step(), 17);
  // Ranks out of order on the wire are put back in global rank order.
  std::swap(*wire.mutable_ranks(0), *wire.mutable_ranks(2));
  auto back = from_proto(wire);
  EXPECT_EQ(back.generation, 9u);
  EXPECT_EQ(back.world_size, 3);
  EXPECT_EQ(back.state_root, 1);
  EXPECT_TRUE(back.drain);
  EXPECT_EQ(back.cause, "node_joined");
  ASSERT_EQ(back.nodes.size(), 2u);
  EXPECT_EQ(back.nodes[0].node_id, "b");
  EXPECT_EQ(back.nodes[0].local_ranks, (std::vector<int32_t>{1}));
  EXPECT_EQ(back.nodes[1].node_id, "a");
  EXPECT_EQ(back.nodes[1].first_global_rank, 1);
  EXPECT_EQ(back.nodes[1].local_ranks, (std::vector<int32_t>{0, 1}));
  ASSERT_EQ(back.ranks.size(), 3u);
  EXPECT_EQ(back.ranks[0].node_id, "b");
  EXPECT_EQ(back.ranks[0].local_rank, 1);
  EXPECT_EQ(back.ranks[2].global_rank, 2);
}
