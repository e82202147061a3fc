// The coordinator's membership and job actors under CAF's deterministic test
// coordinator: no sleeps, the clock moves only in advance().
#include "actors/membership_actor.hpp"
#include "actors/job_actor.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <variant>

#include "actor_test_util.hpp"
#include "net/plan_layout.hpp"

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

// Generation `g` (a's two ranks, then b's one) as node `only` reports it
// after a coordinator restart: its own slice of it.
pb::generation_plan running_plan(uint64_t g, const std::string& only) {
  pb::generation_plan p;
  p.set_generation(g);
  p.set_world_size(3);
  p.set_state_root(0);
  add_node_ranks(p, 2);
  add_node_ranks(p, 1);
  const std::vector<std::pair<std::string, int32_t>> slots{{"a", 0}, {"a", 1}, {"b", 0}};
  for (int32_t r = 0; r < 3; ++r) {
    if (slots[r].first != only) continue;
    auto* a = p.add_ranks();
    a->set_node_id(slots[r].first);
    a->set_local_rank(slots[r].second);
    a->set_global_rank(r);
  }
  return p;
}

inbound joined_in(const std::string& node_id, int32_t nproc, uint64_t g) {
  auto in = joined(node_id, nproc);
  *in.env.mutable_register_node()->mutable_current_plan() = running_plan(g, node_id);
  in.env.mutable_register_node()->set_last_generation(g);
  in.env.set_generation(g);
  return in;
}

void expect_plan(const pb::generation_plan& p, uint64_t generation, int32_t world_size, const std::string& cause, bool drain) {
  EXPECT_EQ(p.generation(), generation);
  EXPECT_EQ(p.world_size(), world_size);
  EXPECT_EQ(to_string(cause_of(p)), cause);
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
  std::vector<int64_t> kept;  // what the commit says the store keeps (empty: not known)

  void start(coordinator_options o, int64_t max_steps = 100) {
    job_options jo;
    jo.max_steps = max_steps;
    jo.header = o.header;
    jo.events = [this](const ev::event& e) { events.push_back(e); };
    jo.stop_timeout = 30s;
    if (!o.events) o.events = jo.events;
    if (with_writer) {
      checkpoint_writer_options wo;
      wo.events = jo.events;
      wo.commit = [this](pb::checkpoint_meta m) -> result<saved_checkpoint> {
        if (fail_saves) return make_error("disk full");
        saved.emplace_back(m.generation(), m.step());
        manifests.push_back(m);
        return saved_checkpoint{"ckpt-" + std::to_string(m.step()), static_cast<int64_t>(m.state_bytes()), 0.5, kept};
      };
      writer = spawn(checkpoint_writer, wo);
    }
    job = spawn(job_actor, jo, writer);
    members = spawn(membership_actor, o, wire.sink(), job);
    caf::anon_send(job, members_atom::value, members);
    if (writer) caf::anon_send(writer, members_atom::value, members);
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
  template <class T>
  std::vector<T> of() const {
    std::vector<T> out;
    for (const auto& e : events)
      if (const auto* x = std::get_if<T>(&e)) out.push_back(*x);
    return out;
  }

  // Heartbeats from `ids` every 100 ms for `total`.
  void keep_alive(std::initializer_list<std::string> ids, std::chrono::milliseconds total) {
    for (auto done = 0ms; done < total; done += 100ms) {
      for (const auto& id : ids) send(heartbeat_from(id, seq++));
      advance(std::min(100ms, total - done));
    }
  }

  // The leader of a pair (opts.orphaned set, saying into `said`; orphaned
  // 2 s after the last node was heard), a and b trained in generation 1.
  void start_a_pair_member_with_a_and_b(std::vector<std::string>& said) {
    auto o = coord_opts(1);
    o.orphaned = [&said](const std::string& why) { said.push_back(why); };
    o.orphan_after = 2000ms;
    start(o);
    send(joined("a", 1));
    send(joined("b", 1));
    keep_alive({"a", "b"}, 300ms);
    trained();
  }

  pb::generation_plan last_plan(const std::string& peer) { return wire.with(pb::envelope::kGenerationPlan, peer).back().env.generation_plan(); }

  // Nodes here got every plan sent to them: a heartbeat built without a
  // generation from a node of the current plan carries that plan's (as a
  // node's does), unless a test turns that off to play a node that lost
  // its plan.
  bool beats_follow_plans = true;

  void send(const inbound& in) {
    const auto& cur = ms().members.state().current;
    const node_id from{in.env.has_heartbeat() && in.peer.rfind("peer-", 0) == 0 ? in.peer.substr(5) : std::string()};
    if (beats_follow_plans && cur && !from.empty() && in.env.generation() == 0 &&
        std::any_of(cur->nodes.begin(), cur->nodes.end(), [&](const plan_node& n) { return n.node_id == from; })) {
      auto stamped = in;
      stamped.env.set_generation(cur->generation);
      caf::anon_send(members, stamped);
    } else {
      caf::anon_send(members, in);
    }
    run();
  }

  membership_actor_state& ms() { return state_of<membership_actor_state>(members); }

  // Every rank of the current plan reports READY in its generation (each
  // then holds that generation's state), as a generation that trained.
  void trained() {
    if (!ms().members.state().current) return;
    const plan cur = *ms().members.state().current;
    for (const auto& r : cur.ranks) {
      const auto* n = ms().members.find(r.node_id);
      send(status_from(r.node_id.str(), r.local_rank, pb::rank_status::STATE_READY, cur.generation, n ? n->incarnation : 1));
    }
  }
  job_actor_state& js() { return state_of<job_actor_state>(job); }

  wire_log wire;
  job_handle job;
  membership_handle members;
  std::vector<ev::event> events;
  uint64_t seq = 0;
  bool with_writer = false;
  bool fail_saves = false;
  checkpoint_writer_handle writer;
  std::vector<std::pair<uint64_t, int64_t>> saved;  // (generation, step) the fake store committed
  std::vector<pb::checkpoint_meta> manifests;        // what it was given
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

namespace {

inbound finished_from(const std::string& node_id, int32_t global_rank, int64_t step, uint64_t generation, const std::string& digest) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  auto* s = in.env.mutable_rank_status();
  s->set_status(pb::rank_status::STATE_FINISHED);
  s->set_global_rank(global_rank);
  s->set_step(step);
  s->set_detail(digest);
  return in;
}

// A rank's report that it stored the byte ranges `ranges` of the checkpoint
// at `step` (of `state_bytes`), a part each ("part-<step>-<rank>" for the
// first, "part-<step>-<rank>.<k>" for the k-th).
inbound checkpoint_parts_from(const std::string& node_id, int64_t step, uint64_t generation, int32_t rank, int32_t world,
                              const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t state_bytes) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  auto* w = in.env.mutable_checkpoint_written();
  w->set_step(step);
  w->set_global_rank(rank);
  w->set_world_size(world);
  w->set_stall_s(0.01 * (rank + 1));
  w->set_write_s(0.5 * (rank + 1));
  for (size_t k = 0; k < ranges.size(); ++k) {
    auto* p = w->add_parts();
    p->set_name("part-" + std::to_string(step) + "-" + std::to_string(rank) + (k == 0 ? "" : "." + std::to_string(k)));
    p->set_offset(ranges[k].first);
    p->set_size(ranges[k].second - ranges[k].first);
    p->set_rank(rank);
  }
  if (rank == 0) {
    pb::checkpoint_meta m;
    m.set_step(step);
    m.set_state_bytes(state_bytes);
    w->set_meta(m.SerializeAsString());
  }
  return in;
}

// A rank's report that it stored its part of the checkpoint at `step`
// (1000 state bytes split evenly), or (with `error`) that it could not.
inbound checkpoint_from(const std::string& node_id, int64_t step, uint64_t generation, int32_t rank = 0, int32_t world = 1,
                        const std::string& error = "") {
  const uint64_t share = static_cast<uint64_t>(1000 / world), at = share * static_cast<uint64_t>(rank);
  auto in = checkpoint_parts_from(node_id, step, generation, rank, world, {{at, at + share}}, 1000);
  if (!error.empty()) {
    in.env.mutable_checkpoint_written()->clear_parts();
    in.env.mutable_checkpoint_written()->clear_meta();
    in.env.mutable_checkpoint_written()->set_error(error);
  }
  return in;
}

// Waits for the job's end as the coordinator's main thread does.
struct waiter_state {
  std::shared_ptr<int> code;
  static inline const char* name = "test.waiter";
};
caf::behavior waiter(caf::stateful_actor<waiter_state>* self, job_handle job, std::shared_ptr<int> code) {
  self->state.code = code;
  self->send(job, wait_atom::value);
  return {[=](done_atom, int c) { *self->state.code = c; }};
}

// The exit code the job ends with (-1 until it ended), as the main thread sees it.
std::shared_ptr<int> await_end(caf_fixture& f, const job_handle& job) {
  auto code = std::make_shared<int>(-1);
  f.spawn(waiter, job, code);
  return code;
}

template <class T>
std::ptrdiff_t index_of(const std::vector<ev::event>& events) {
  auto it = std::find_if(events.begin(), events.end(), [](const ev::event& e) { return std::holds_alternative<T>(e); });
  return it == events.end() ? -1 : it - events.begin();
}

}  // namespace

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

TEST_F(coordinator_actors, checkpoints_are_saved_before_the_end_and_the_newest_goes_into_a_plan_without_a_holder) {
  with_writer = true;
  start(coord_opts(1), 5);
  send(joined("a", 1));
  advance(100ms);
  send(checkpoint_from("a", 3, 1));
  send(checkpoint_from("a", 2, 0));  // another generation: fenced off
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_EQ(saved[0], std::make_pair(uint64_t{1}, int64_t{3}));
  ASSERT_EQ(of<ev::checkpoint_saved>().size(), 1u);
  EXPECT_EQ(of<ev::checkpoint_saved>()[0].path, "ckpt-3");
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), 3);
  // a is lost and comes back as a new process: the new generation has no
  // state holder and starts from the checkpoint.
  advance(1200ms);
  send(joined("a", 1, 2));
  advance(200ms);
  auto p = last_plan("peer-a");
  EXPECT_GE(p.generation(), 2u);
  EXPECT_EQ(p.state_root(), 0);
  EXPECT_EQ(p.checkpoint_step(), 3);
  // The final checkpoint is saved before the end is announced.
  send(checkpoint_from("a", 5, p.generation()));
  send(finished_from("a", 0, 5, p.generation(), "d"));
  ASSERT_EQ(of<ev::job_ended>().size(), 1u);
  EXPECT_LT(index_of<ev::checkpoint_saved>(events), index_of<ev::job_ended>(events));
  EXPECT_EQ(of<ev::checkpoint_saved>().back().step, 5);
}

// A node whose ranks opened other data than the coordinator's (a truncated
// copy, another version) is refused with one line naming the file and is
// never planned in; a file the coordinator does not have takes the first
// node's digest as the reference.
TEST_F(coordinator_actors, a_node_with_different_data_files_is_refused_and_never_trained_on) {
  auto o = coord_opts(2);
  o.data_digests = {{"/data/x.npy", "4096:aaaa"}};
  start(o, 100);
  auto idle = [](const std::string& node, std::map<std::string, std::string> digests) {
    auto in = status_from(node, 0, pb::rank_status::STATE_IDLE);
    for (auto& [k, v] : digests) (*in.env.mutable_rank_status()->mutable_data_digests())[k] = v;
    return in;
  };
  send(register_from("a", 1));
  send(register_from("b", 1));
  send(register_from("c", 1));
  send(idle("a", {{"/data/x.npy", "4096:aaaa"}, {"/data/y.npy", "64:1111"}}));
  send(idle("b", {{"/data/x.npy", "2048:bbbb"}, {"/data/y.npy", "64:1111"}}));
  advance(300ms);
  EXPECT_TRUE(wire.with(pb::envelope::kGenerationPlan, "peer-a").empty()) << "b is refused: only one node is ready";
  auto errors = of<ev::job_error>();
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].node, "b");
  EXPECT_EQ(errors[0].message, "data file '/data/x.npy' on node 'b' differs from the coordinator's (2048:bbbb, expected 4096:aaaa): the node is refused");
  auto down = wire.with(pb::envelope::kShutdown, "peer-b");
  ASSERT_EQ(down.size(), 1u);
  EXPECT_EQ(down[0].env.shutdown().reason(), errors[0].message);
  EXPECT_TRUE(down[0].env.shutdown().refused());
  // y.npy is not on the coordinator: a's digest is the reference.
  send(idle("c", {{"/data/x.npy", "4096:aaaa"}, {"/data/y.npy", "64:2222"}}));
  ASSERT_EQ(of<ev::job_error>().size(), 2u);
  EXPECT_NE(of<ev::job_error>()[1].message.find("data file '/data/y.npy' on node 'c' differs"), std::string::npos);
  // A node with the same files is planned in with a.
  send(register_from("d", 1));
  send(idle("d", {{"/data/x.npy", "4096:aaaa"}, {"/data/y.npy", "64:1111"}}));
  advance(300ms);
  auto p = last_plan("peer-a");
  ASSERT_EQ(p.world_size(), 2);
  std::set<std::string> nodes;
  for (const auto& n : ms().members.state().current->nodes) nodes.insert(n.node_id.str());
  EXPECT_EQ(nodes, (std::set<std::string>{"a", "d"}));
  EXPECT_EQ(node_rank_counts(p, 2).size(), 2u);
  // A node whose rank cannot even load the data (its warm-up fails) is
  // refused the same way, in one line, instead of waiting unseen.
  send(register_from("e", 1));
  auto failed = status_from("e", 0, pb::rank_status::STATE_FAILED);
  failed.env.mutable_rank_status()->set_detail("data.train_inputs has 1000 samples, data.train_targets 1024");
  failed.env.mutable_rank_status()->set_global_rank(-1);  // the warm-up's (in no generation yet)
  send(failed);
  ASSERT_EQ(of<ev::job_error>().size(), 3u);
  EXPECT_EQ(of<ev::job_error>()[2].message, "node 'e' cannot start rank 0: data.train_inputs has 1000 samples, data.train_targets 1024");
  EXPECT_EQ(wire.with(pb::envelope::kShutdown, "peer-e").size(), 1u);
}

TEST_F(coordinator_actors, a_checkpoint_is_committed_once_every_rank_stored_its_part) {
  with_writer = true;
  start(coord_opts(1), 50);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  const uint64_t gen = last_plan("peer-a").generation();
  ASSERT_EQ(last_plan("peer-a").world_size(), 2);
  send(checkpoint_from("b", 4, gen, 1, 2));
  EXPECT_TRUE(saved.empty()) << "rank 0's part (and the manifest body) is still out";
  send(checkpoint_from("a", 4, gen, 0, 2));
  ASSERT_EQ(saved.size(), 1u);
  const auto& m = manifests[0];
  EXPECT_EQ(m.generation(), gen) << "the fence is the envelope's generation, not what a rank wrote";
  EXPECT_EQ(m.world_size(), 2);
  ASSERT_EQ(m.parts_size(), 2);
  EXPECT_EQ(m.parts(0).name(), "part-4-0");
  EXPECT_EQ(m.parts(1).name(), "part-4-1");
  auto ev = of<ev::checkpoint_saved>();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].parts, 2);
  EXPECT_FALSE(ev[0].due_step) << "taken when due";
  EXPECT_DOUBLE_EQ(ev[0].stall_s, 0.02) << "the slowest rank's";
  EXPECT_DOUBLE_EQ(ev[0].write_s, 1.0);
  EXPECT_DOUBLE_EQ(ev[0].bytes_per_s, 1000.0);
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), 4);

  // A rank that could not store its part: reported once, never committed.
  send(checkpoint_from("a", 8, gen, 0, 2));
  send(checkpoint_from("b", 8, gen, 1, 2, "cannot write '/ckpt/x' (write): No space left on device"));
  EXPECT_EQ(saved.size(), 1u);
  auto failed = of<ev::checkpoint_failed>();
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].step, 8);
  EXPECT_EQ(failed[0].reason, "rank 1 (b) could not store its part: cannot write '/ckpt/x' (write): No space left on device");
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), 4);

  // Parts of an older generation are fenced off by the job actor.
  send(checkpoint_from("a", 12, gen - 1, 0, 1));
  EXPECT_EQ(saved.size(), 1u);

  // Deferred (checkpoint.defer_while_writing): due at step 14, taken at 15 on both ranks.
  for (int32_t r : {0, 1}) {
    auto part = checkpoint_from(r == 0 ? "a" : "b", 15, gen, r, 2);
    part.env.mutable_checkpoint_written()->set_due_step(14);
    send(part);
  }
  ASSERT_EQ(saved.size(), 2u);
  EXPECT_EQ(of<ev::checkpoint_saved>().back().step, 15);
  EXPECT_EQ(of<ev::checkpoint_saved>().back().due_step, std::optional<int64_t>(14));
}

// ZeRO: a rank owns scattered ranges of the stream and stores each as a part
// of its own; the manifest lists every rank's parts in stream order.
TEST_F(coordinator_actors, ranks_with_several_parts_each_commit_one_manifest_of_all_parts_in_offset_order) {
  with_writer = true;
  start(coord_opts(1), 50);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  const uint64_t gen = last_plan("peer-a").generation();
  ASSERT_EQ(last_plan("peer-a").world_size(), 2);
  send(checkpoint_parts_from("b", 4, gen, 1, 2, {{10, 20}, {30, 40}}, 40));
  EXPECT_TRUE(saved.empty()) << "rank 0's parts are still out";
  send(checkpoint_parts_from("a", 4, gen, 0, 2, {{0, 10}, {20, 30}}, 40));
  ASSERT_EQ(saved.size(), 1u) << (of<ev::checkpoint_failed>().empty() ? "" : of<ev::checkpoint_failed>()[0].reason);
  const auto& m = manifests[0];
  EXPECT_EQ(m.world_size(), 2);
  ASSERT_EQ(m.parts_size(), 4);
  const std::vector<std::string> names{"part-4-0", "part-4-1", "part-4-0.1", "part-4-1.1"};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(m.parts(i).name(), names[static_cast<size_t>(i)]);
    EXPECT_EQ(m.parts(i).offset(), static_cast<uint64_t>(10 * i));
    EXPECT_EQ(m.parts(i).size(), 10u);
    EXPECT_EQ(m.parts(i).rank(), i % 2);
  }
  auto ev = of<ev::checkpoint_saved>();
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].parts, 4);
  EXPECT_TRUE(of<ev::checkpoint_failed>().empty());
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), 4);
}

// Parts that do not tile the stream (a gap, an overlap) are never committed:
// a resume would read bytes no rank wrote.
TEST_F(coordinator_actors, parts_that_leave_a_gap_or_overlap_are_reported_and_never_committed) {
  with_writer = true;
  start(coord_opts(1), 50);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  const uint64_t gen = last_plan("peer-a").generation();
  ASSERT_EQ(last_plan("peer-a").world_size(), 2);
  send(checkpoint_parts_from("a", 4, gen, 0, 2, {{0, 10}, {30, 40}}, 40));
  send(checkpoint_parts_from("b", 4, gen, 1, 2, {{10, 20}}, 40));
  EXPECT_TRUE(saved.empty());
  auto failed = of<ev::checkpoint_failed>();
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].step, 4);
  EXPECT_EQ(failed[0].reason, "no rank stored bytes [20, 30) of the state");

  // The end of the stream missing.
  send(checkpoint_parts_from("a", 6, gen, 0, 2, {{0, 10}}, 40));
  send(checkpoint_parts_from("b", 6, gen, 1, 2, {{10, 20}, {20, 30}}, 40));
  ASSERT_EQ(of<ev::checkpoint_failed>().size(), 2u);
  EXPECT_EQ(of<ev::checkpoint_failed>()[1].reason, "no rank stored bytes [30, 40) of the state");

  // Two ranks claiming the same bytes.
  send(checkpoint_parts_from("a", 8, gen, 0, 2, {{0, 25}}, 40));
  send(checkpoint_parts_from("b", 8, gen, 1, 2, {{20, 40}}, 40));
  ASSERT_EQ(of<ev::checkpoint_failed>().size(), 3u);
  EXPECT_EQ(of<ev::checkpoint_failed>()[2].reason, "part 'part-8-1' of rank 1 overlaps bytes [20, 25) of another part");
  EXPECT_TRUE(saved.empty());
  EXPECT_TRUE(of<ev::checkpoint_saved>().empty());
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), -1);

  // A report with neither parts nor an error is a failure too.
  send(checkpoint_parts_from("a", 10, gen, 0, 2, {{0, 20}}, 40));
  send(checkpoint_parts_from("b", 10, gen, 1, 2, {}, 40));
  ASSERT_EQ(of<ev::checkpoint_failed>().size(), 4u);
  EXPECT_EQ(of<ev::checkpoint_failed>()[3].reason, "rank 1 (b) could not store its part: it reported no parts");
  EXPECT_TRUE(saved.empty());
}

TEST_F(coordinator_actors, a_checkpoint_the_store_refuses_is_reported_and_not_offered_to_plans) {
  with_writer = true;
  fail_saves = true;
  start(coord_opts(1), 5);
  send(joined("a", 1));
  advance(100ms);
  send(checkpoint_from("a", 3, 1));
  ASSERT_EQ(of<ev::checkpoint_failed>().size(), 1u);
  EXPECT_EQ(of<ev::checkpoint_failed>()[0].reason, "disk full");
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), -1);
}

namespace {
// A rank that refused the checkpoint at `step` (FAILURE_CHECKPOINT).
inbound refusal_from(const std::string& node_id, uint64_t generation, int64_t step) {
  auto in = status_from(node_id, 0, pb::rank_status::STATE_FAILED, generation);
  auto* s = in.env.mutable_rank_status();
  s->set_failure(pb::rank_status::FAILURE_CHECKPOINT);
  s->set_refused_checkpoint_step(step);
  s->set_detail("checkpoint /ckpt/ckpt-" + std::to_string(step) + ".manifest: checksum mismatch in part 'p'");
  return in;
}
}  // namespace

// A checkpoint damaged after the coordinator's start-up check: the rank
// refuses it; it is marked bad for the job (journaled once), the next plan
// loads the previous one, and with none left the job fails with one line
// and plans nothing more (before: the same checkpoint, generation after
// generation).
TEST_F(coordinator_actors, a_checkpoint_a_rank_refuses_is_never_planned_again_and_the_next_plan_falls_back) {
  auto o = coord_opts(1);
  o.checkpoints = ledger_at_start({10, 20, 30}, 20);  // 30 did not check out at start
  start(o, 100);
  auto code = await_end(*this, job);
  send(joined("a", 1));
  keep_alive({"a"}, 100ms);
  const auto g1 = last_plan("peer-a");
  ASSERT_EQ(g1.checkpoint_step(), 20);
  EXPECT_EQ(g1.bad_checkpoint_steps_size(), 0);
  EXPECT_EQ(g1.fallback_checkpoint_step(), 20);
  send(refusal_from("a", g1.generation(), 20));
  send(refusal_from("a", g1.generation(), 20));  // the same, reported again: one mark
  auto refused = of<ev::checkpoint_refused>();
  ASSERT_EQ(refused.size(), 1u);
  EXPECT_EQ(refused[0].step, 20);
  EXPECT_EQ(refused[0].node, "a");
  EXPECT_EQ(refused[0].generation, g1.generation());
  EXPECT_EQ(refused[0].fallback_step, 10);
  EXPECT_EQ(refused[0].reason, "checkpoint /ckpt/ckpt-20.manifest: checksum mismatch in part 'p'");
  keep_alive({"a"}, 400ms);
  const auto g2 = last_plan("peer-a");
  ASSERT_GT(g2.generation(), g1.generation());
  EXPECT_EQ(g2.state_root(), 0);
  EXPECT_EQ(g2.checkpoint_step(), 10);
  ASSERT_EQ(g2.bad_checkpoint_steps_size(), 1);
  EXPECT_EQ(g2.fallback_checkpoint_step(), 10) << "the refused one is not fallen back to either";
  EXPECT_EQ(g2.bad_checkpoint_steps(0), 20);
  EXPECT_TRUE(of<ev::job_ended>().empty());

  const auto plans = wire.count(pb::envelope::kGenerationPlan, "peer-a");
  send(refusal_from("a", g2.generation(), 10));
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::failed);
  EXPECT_EQ(end[0].reason,
            "rank 0 on node 'a' refused the checkpoint at step 10 (checkpoint /ckpt/ckpt-10.manifest: checksum mismatch in part 'p'): no other "
            "committed checkpoint is left that no rank refused; the job cannot resume (restore the checkpoint store, or start over with "
            "--no-resume)");
  EXPECT_FALSE(end[0].resumable) << "no checkpoint is left to resume from";
  EXPECT_EQ(*code, 1);
  EXPECT_LT(index_of<ev::rank_down>(events), index_of<ev::job_ended>(events));
  keep_alive({"a"}, 1000ms);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan, "peer-a"), plans) << "nothing is planned after the job failed";
}

// A step a rank refused and the job committed again (it trained there from
// the previous checkpoint) is another checkpoint: planned again. Rotated
// ones are not planned at all.
TEST_F(coordinator_actors, a_step_committed_again_after_a_refusal_is_planned_and_rotated_checkpoints_are_not) {
  with_writer = true;
  auto o = coord_opts(1);
  o.checkpoints = ledger_at_start({5, 10}, 10);
  start(o, 100);
  send(joined("a", 1));
  keep_alive({"a"}, 100ms);
  const auto g1 = last_plan("peer-a");
  ASSERT_EQ(g1.checkpoint_step(), 10);
  send(refusal_from("a", g1.generation(), 10));
  keep_alive({"a"}, 400ms);
  const auto g2 = last_plan("peer-a");
  ASSERT_EQ(g2.checkpoint_step(), 5);
  kept = {5, 10};
  send(checkpoint_from("a", 10, g2.generation()));
  ASSERT_EQ(saved.size(), 1u);
  EXPECT_TRUE(ms().checkpoints.bad.empty());
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), 10);
  kept = {10, 15};  // checkpoint.keep_last = 2: 5 went
  send(checkpoint_from("a", 15, g2.generation()));
  EXPECT_EQ(ms().checkpoints.committed, (std::set<int64_t>{10, 15}));
  EXPECT_EQ(plan_checkpoint(ms().checkpoints), 15);
}

TEST_F(coordinator_actors, step_reports_become_one_completed_step_with_the_sample_weighted_loss) {
  start(coord_opts(1), 100);
  send(joined("a", 2));
  advance(100ms);
  auto rep = [](int32_t rank, double loss, int64_t samples, double step_s) {
    auto in = step_from("a", rank, 1, 1);
    auto* r = in.env.mutable_step_report();
    r->set_world_size(2);
    r->set_loss(loss);
    r->set_samples(samples);
    r->set_step_s(step_s);
    return in;
  };
  send(rep(0, 1.0, 30, 0.1));
  EXPECT_TRUE(of<ev::step_completed>().empty());
  send(rep(1, 2.0, 10, 0.2));
  auto done = of<ev::step_completed>();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_DOUBLE_EQ(done[0].loss, 1.25);
  EXPECT_EQ(done[0].samples, 40);
  EXPECT_DOUBLE_EQ(done[0].samples_per_s, 200.0);  // the slowest rank's time
}

// A node lost at the very end, once every rank took the last step, the final
// checkpoint's parts are all stored and the final evaluation is in: the job
// ends with it. No new generation would load the final checkpoint, commit it
// again and evaluate again (as a node flapping on a loaded machine made it).
TEST_F(coordinator_actors, a_node_lost_after_the_final_checkpoint_and_evaluation_ends_the_job_without_a_new_generation) {
  start(coord_opts(1), 5);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  ASSERT_EQ(ms().members.state().current->generation, 1u);
  trained();
  send(step_from("a", 0, 5, 1));
  send(step_from("b", 1, 5, 1));
  send(checkpoint_from("a", 5, 1, 0, 2));
  send(checkpoint_from("b", 5, 1, 1, 2));
  inbound eval{links::nodes, "peer-a", node_envelope("a", 1, 1)};
  eval.env.mutable_eval_report()->set_step(5);
  (*eval.env.mutable_eval_report()->mutable_metrics())["accuracy"] = 0.9;
  send(eval);
  EXPECT_FALSE(js().ending) << "the ranks still say FINISHED";
  wire.clear();
  // b falls silent before its ranks said FINISHED.
  for (int i = 0; i < 12 && !js().ended; ++i) {
    send(heartbeat_from("a", seq++));
    advance(100ms);
  }
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_TRUE(js().ended);
  auto end = of<ev::job_ended>();
  ASSERT_EQ(end.size(), 1u);
  EXPECT_EQ(end[0].how, ev::outcome::finished);
  EXPECT_EQ(end[0].step, 5);
  EXPECT_DOUBLE_EQ(end[0].metrics.at("accuracy"), 0.9);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 0u) << "a new generation was planned after the job's result was complete";
  EXPECT_GE(wire.count(pb::envelope::kShutdown), 1u);
}

// Before the final checkpoint is stored, a loss is recovered as any other.
TEST_F(coordinator_actors, a_node_lost_before_the_final_checkpoint_is_stored_is_recovered_as_usual) {
  start(coord_opts(1), 5);
  send(joined("a", 1));
  send(joined("b", 1));
  advance(100ms);
  trained();
  send(step_from("a", 0, 5, 1));
  send(step_from("b", 1, 5, 1));
  send(checkpoint_from("a", 5, 1, 0, 2));
  wire.clear();
  for (int i = 0; i < 12; ++i) {
    send(heartbeat_from("a", seq++));
    advance(100ms);
  }
  ASSERT_EQ(ms().lost.size(), 1u);
  EXPECT_FALSE(js().ending);
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 1u);
}
