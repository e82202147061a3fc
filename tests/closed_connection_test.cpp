// Detection from a closed connection, under CAF's deterministic test
// coordinator: the clock moves only in advance(), so "at once" means with
// no time passed at all.
#include <gtest/gtest.h>

#include <variant>

#include "actor_test_util.hpp"
#include "actors/membership_actor.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

inbound joined(const std::string& node_id) {
  auto in = register_from(node_id, 1);
  in.env.mutable_register_node()->add_ready_ranks(0);
  return in;
}

inbound failed_in(const std::string& node_id, uint64_t generation) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  in.env.mutable_rank_status()->set_local_rank(0);
  in.env.mutable_rank_status()->set_status(pb::rank_status::STATE_FAILED);
  return in;
}

// The membership actor alone (no job actor: plans go out at once), with
// nodes a and b (one rank each) training in generation 1.
class closed_connection : public ::testing::Test, public caf_fixture {
 protected:
  void SetUp() override {
    coordinator_options o;
    o.membership.min_nodes = 2;
    o.liveness = liveness_options{100ms, 1000ms, 300ms};
    o.liveness.closed_grace = 300ms;
    o.membership.suspect_timeout = 300ms;
    o.header = envelope_header{1, "job", "coordinator", 1};
    o.events = [this](const ev::event& e) {
      if (const auto* l = std::get_if<ev::node_lost>(&e)) lost.push_back(*l);
    };
    members = spawn(membership_actor, o, wire.sink(), job_handle{});
    run();
    send(joined("a"));
    send(joined("b"));
    keep_alive({"a", "b"}, 200ms);
    ASSERT_TRUE(ms().members.state().current);
    ASSERT_EQ(ms().members.state().current->generation, 1u);
  }

  void send(const inbound& in) {
    caf::anon_send(members, in);
    run();
  }
  void closed(const std::string& peer) {
    caf::anon_send(members, closed_atom::value, peer);
    run();
  }
  void keep_alive(std::initializer_list<std::string> ids, std::chrono::milliseconds total) {
    for (auto done = 0ms; done < total; done += 100ms) {
      for (const auto& id : ids) send(heartbeat_from(id, seq++));
      advance(std::min(100ms, total - done));
    }
  }
  membership_actor_state& ms() { return state_of<membership_actor_state>(members); }
  uint64_t generation() { return ms().members.state().current->generation; }
  pb::generation_plan last_plan(const std::string& peer) { return wire.with(pb::envelope::kGenerationPlan, peer).back().env.generation_plan(); }

  wire_log wire;
  membership_handle members;
  std::vector<ev::node_lost> lost;
  uint64_t seq = 0;
};

}  // namespace

TEST_F(closed_connection, after_a_failed_collective_a_closed_connection_is_a_loss_and_a_plan_at_once) {
  send(failed_in("a", 1));
  ASSERT_TRUE(ms().members.suspecting());
  const auto before = now();
  closed("peer-b");
  EXPECT_EQ(now(), before);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, ev::loss_cause::connection_closed);
  EXPECT_EQ(generation(), 2u);
  auto p = last_plan("peer-a");
  EXPECT_EQ(p.generation(), 2u);
  EXPECT_EQ(p.world_size(), 1);
}

TEST_F(closed_connection, a_collective_failure_after_the_close_is_a_loss_at_once_too) {
  closed("peer-b");
  EXPECT_TRUE(lost.empty()) << "a close alone waits for its grace";
  send(failed_in("a", 1));
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, ev::loss_cause::connection_closed);
  EXPECT_EQ(last_plan("peer-a").generation(), 2u);
}

TEST_F(closed_connection, a_close_alone_is_a_loss_after_the_grace_well_before_the_heartbeat_timeout) {
  closed("peer-b");
  keep_alive({"a"}, 200ms);
  EXPECT_TRUE(lost.empty());
  keep_alive({"a"}, 200ms);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].node, "b");
  EXPECT_EQ(lost[0].cause, ev::loss_cause::connection_closed);
  EXPECT_LT(lost[0].detected_after_s, 0.5);
  EXPECT_EQ(last_plan("peer-a").world_size(), 1);
}

TEST_F(closed_connection, a_node_heard_from_again_within_the_grace_stays) {
  closed("peer-b");
  keep_alive({"a"}, 100ms);
  keep_alive({"a", "b"}, 1500ms);  // b redialled and heartbeats again
  EXPECT_TRUE(lost.empty());
  EXPECT_NE(ms().members.find(node_id{"b"}), nullptr);
  EXPECT_EQ(generation(), 1u);
  // A later collective failure does not hold the old close against it.
  send(failed_in("a", 1));
  EXPECT_TRUE(lost.empty());
}

TEST_F(closed_connection, a_suspected_node_that_answers_is_kept) {
  send(failed_in("a", 1));
  keep_alive({"a", "b"}, 1000ms);
  EXPECT_TRUE(lost.empty());
  EXPECT_NE(ms().members.find(node_id{"b"}), nullptr);
  EXPECT_EQ(last_plan("peer-b").world_size(), 2) << "the same members start over";
}

TEST_F(closed_connection, a_close_of_a_routing_id_no_member_holds_changes_nothing) {
  send(failed_in("a", 1));
  closed("peer-stranger");
  EXPECT_TRUE(lost.empty());
  EXPECT_EQ(generation(), 1u);
}

TEST_F(closed_connection, a_silent_node_whose_connection_never_closed_waits_for_the_heartbeat_timeout) {
  keep_alive({"a"}, 800ms);  // b's last heartbeat was 900 ms ago
  EXPECT_TRUE(lost.empty());
  keep_alive({"a"}, 200ms);
  ASSERT_EQ(lost.size(), 1u);
  EXPECT_EQ(lost[0].cause, ev::loss_cause::heartbeat_timeout);
}
