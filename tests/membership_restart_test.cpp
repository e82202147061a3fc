// The membership of a restarted coordinator: adopting the running
// generation, restarts of nodes, and the start gate against the floor.
#include <gtest/gtest.h>

#include "membership_test_util.hpp"

using namespace dtactor;
using namespace dtactor::membership_test;
using namespace std::chrono_literals;

// -- coordinator restart: adopting the running generation ---------------------------

namespace {

// Generation `g` as the nodes report it: a (2 ranks) then b (1 rank).
plan running(uint64_t g) {
  plan p;
  p.generation = g;
  p.world_size = 3;
  p.state_root = 0;
  p.cause = plan_cause::node_joined;
  p.drain = true;
  p.nodes = {plan_node{node_id{"a"}, "", "", -1, 2, 0, 0, {0, 1}}, plan_node{node_id{"b"}, "", "", -1, 1, 2, 0, {0}}};
  p.ranks = {rank_slot{node_id{"a"}, 0, 0, 0}, rank_slot{node_id{"a"}, 1, 1, 0}, rank_slot{node_id{"b"}, 0, 2, 0}};
  return p;
}

node_registration in_plan(const std::string& id, int32_t nproc, uint64_t g, uint64_t incarnation = 1) {
  auto r = reg(id, nproc, incarnation);
  r.last_generation = g;
  r.current_plan = running(g);
  return r;
}

}  // namespace

TEST(membership, a_new_coordinator_adopts_the_generation_its_nodes_train_in) {
  auto o = opts(1);
  o.adopt_timeout = 2s;
  o.settle = 300ms;
  membership m(o);
  m.admit(in_plan("b", 1, 7), t0());  // b registers first: node rank 0 for now
  auto d = m.decide(t0() + 100ms);
  EXPECT_FALSE(d.next);
  EXPECT_NE(d.reason.find("to adopt generation 7: node 'a' has not registered"), std::string::npos) << d.reason;
  EXPECT_EQ(m.state().last_generation, 7u);
  auto a = cold("a", 2);
  a.current_plan = running(7);
  m.admit(a, t0() + 200ms);
  EXPECT_NE(m.decide(t0() + 200ms).reason.find("rank 0 of node 'a' is not ready"), std::string::npos);
  m.set_rank_ready(node_id{"a"}, 1, 0, true, t0() + 300ms);
  m.set_rank_ready(node_id{"a"}, 1, 1, true, t0() + 300ms);
  auto adopted = m.decide(t0() + 300ms);  // no settling: nothing new starts
  ASSERT_TRUE(adopted.next) << adopted.reason;
  const auto& p = m.commit(*adopted.next);
  EXPECT_TRUE(p.adopted);
  EXPECT_EQ(p.generation, 7u);
  EXPECT_EQ(p.world_size, 3);
  EXPECT_EQ(p.nodes[0].peer, "peer-a");
  EXPECT_EQ(p.nodes[0].incarnation, 1u);
  EXPECT_EQ(m.find(node_id{"a"})->node_rank, 0);  // node ranks follow the plan's order
  EXPECT_EQ(m.find(node_id{"b"})->node_rank, 1);
  EXPECT_FALSE(m.decide(t0() + 1s).next);  // it is current as it is
  // A member outside the adopted plan joins it with a normal drain plan.
  m.admit(reg("c", 1), t0() + 1s);
  auto g8 = *m.decide(t0() + 1300ms).next;
  EXPECT_EQ(g8.generation, 8u);
  EXPECT_EQ(g8.cause, plan_cause::node_joined);
  EXPECT_TRUE(g8.drain);
  EXPECT_EQ(g8.world_size, 4);
  EXPECT_EQ(g8.ranks[2].node_id.str(), "b");
  EXPECT_EQ(g8.state_root, 0);
}

TEST(membership, adoption_takes_the_newest_reported_plan_and_waits_for_its_nodes_generation) {
  auto o = opts(1);
  o.adopt_timeout = 2s;
  membership m(o);
  m.admit(in_plan("a", 2, 8), t0());
  m.admit(in_plan("b", 1, 7), t0());  // b has not switched to 8 yet
  auto d = m.decide(t0() + 1s);
  EXPECT_FALSE(d.next);
  EXPECT_NE(d.reason.find("node 'b' is in generation 7"), std::string::npos) << d.reason;
  m.admit(in_plan("b", 1, 8), t0() + 1s);  // b re-registers once it has switched
  auto p = *m.decide(t0() + 1s).next;
  EXPECT_TRUE(p.adopted);
  EXPECT_EQ(p.generation, 8u);
}

TEST(membership, without_every_node_back_in_time_a_restart_generation_is_planned) {
  auto o = opts(1);
  o.adopt_timeout = 2s;
  membership m(o);
  m.admit(in_plan("a", 2, 7), t0());  // b died while the coordinator was down
  EXPECT_FALSE(m.decide(t0() + 1999ms).next);
  auto p = *m.decide(t0() + 2s).next;
  EXPECT_FALSE(p.adopted);
  EXPECT_EQ(p.generation, 8u);
  EXPECT_EQ(p.cause, plan_cause::restart);
  EXPECT_FALSE(p.drain);
  EXPECT_EQ(p.world_size, 2);
}

TEST(membership, last_generation_follows_the_nodes_so_new_plans_are_newer) {
  membership m(opts(1));
  auto r = reg("a", 1);
  r.last_generation = 12;
  m.admit(r, t0());
  auto p = *m.decide(t0()).next;
  EXPECT_EQ(p.generation, 13u);
  EXPECT_EQ(p.cause, plan_cause::restart);
}

TEST(membership, the_leaving_node_gets_the_plan_where_it_is_reachable_now) {
  membership m(opts(1));
  m.admit(reg("a", 1), t0());
  m.admit(reg("b", 1), t0());
  trained(m, *m.decide(t0()).next);
  EXPECT_TRUE(m.touch(node_id{"b"}, 1, t0() + 1s, "peer-b-reconnected"));
  m.remove(node_id{"b"}, t0() + 1s, departure::left);
  auto p = *m.decide(t0() + 1s).next;
  ASSERT_EQ(p.leaving.size(), 1u);
  EXPECT_EQ(p.leaving[0].peer, "peer-b-reconnected");
}

TEST(membership, a_new_nproc_from_the_same_process_is_no_failure) {
  auto o = opts(1);
  o.flap_max_failures = 1;
  membership m(o);
  m.admit(reg("a", 1), t0());
  auto r = m.admit(reg("a", 2), t0() + 1s);
  EXPECT_TRUE(r.accepted);
  EXPECT_FALSE(r.restarted);
  EXPECT_EQ(m.find(node_id{"a"})->nproc, 2);
  EXPECT_TRUE(m.state().flaps.empty());
}

// -- one id, two live processes (cloned machines, two nodes on one host) -------

TEST(membership, a_second_live_process_under_a_members_id_is_refused_not_taken_for_a_restart) {
  membership m(opts(1));
  m.admit(reg("vm", 1, 1), t0());
  trained(m, *m.decide(t0()).next);
  m.touch(node_id{"vm"}, 1, t0() + 100ms);
  auto r = m.admit(reg("vm", 1, 2), t0() + 150ms);  // the member was heard 50 ms ago
  EXPECT_FALSE(r.accepted);
  EXPECT_TRUE(r.duplicate);
  EXPECT_FALSE(r.restarted);
  EXPECT_NE(r.reason.find("node id 'vm' is in use by a live node (at vm.local"), std::string::npos) << r.reason;
  EXPECT_NE(r.reason.find("--node-id"), std::string::npos) << r.reason;
  // The member is untouched: same process, no loss counted, no new generation.
  ASSERT_NE(m.find(node_id{"vm"}), nullptr);
  EXPECT_EQ(m.find(node_id{"vm"})->incarnation, 1u);
  EXPECT_TRUE(m.state().flaps.empty());
  EXPECT_FALSE(m.decide(t0() + 150ms).next);
  // Every retry while the member lives is refused the same way.
  m.touch(node_id{"vm"}, 1, t0() + 250ms);
  EXPECT_TRUE(m.admit(reg("vm", 1, 2), t0() + 300ms).duplicate);
}

TEST(membership, a_restart_is_recognised_once_the_old_process_is_silent) {
  membership m(opts(1));
  m.admit(reg("vm", 1, 1), t0());
  trained(m, *m.decide(t0()).next);
  m.touch(node_id{"vm"}, 1, t0() + 100ms);
  auto r = m.admit(reg("vm", 1, 2), t0() + 100ms + m.options().duplicate_window);
  EXPECT_TRUE(r.accepted);
  EXPECT_TRUE(r.restarted);
  EXPECT_FALSE(r.duplicate);
  EXPECT_EQ(m.find(node_id{"vm"})->incarnation, 2u);
}

// -- the start gate (min_nodes) and the floor (floor_nodes) --------------------

TEST(membership, min_nodes_gates_the_start_and_the_floor_the_shrink) {
  auto o = opts(2);
  membership m(o);  // floor_nodes defaults to 1
  m.admit(reg("a", 1), t0());
  EXPECT_FALSE(m.decide(t0()).next);
  EXPECT_FALSE(m.decide(t0()).below_floor);  // not started: waiting at the gate
  m.admit(reg("b", 1), t0());
  trained(m, *m.decide(t0()).next);
  m.remove(node_id{"b"}, t0() + 1s);
  auto d = m.decide(t0() + 1s);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(d.next->world_size, 1);

  o.floor_nodes = 2;
  membership f(o);
  f.admit(reg("a", 1), t0());
  f.admit(reg("b", 1), t0());
  trained(f, *f.decide(t0()).next);
  f.remove(node_id{"b"}, t0() + 1s);
  auto w = f.decide(t0() + 1s);
  EXPECT_FALSE(w.next);
  EXPECT_TRUE(w.below_floor);
  EXPECT_EQ(w.reason, "waiting for nodes: 1 node with a ready rank, below the floor of 2 (cluster.floor_nodes) [a]");
}

TEST(membership, a_restarted_coordinator_uses_the_floor_not_the_start_gate) {
  auto o = opts(3);
  o.adopt_timeout = 1s;
  membership m(o);
  auto r = reg("a", 1);
  r.last_generation = 4;  // the job trained under an earlier coordinator
  m.admit(r, t0());
  auto d = m.decide(t0() + 2s);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(d.next->generation, 5u);
}

// Issue 47: one registration claiming 2^31 - 1 ranks made an open
// coordinator plan a world of 100,001. A claim over
// cluster.max_ranks_per_node is refused with the reason; the members stay.
TEST(membership, a_registration_claiming_more_ranks_than_the_limit_is_refused) {
  auto o = opts(1);
  o.max_ranks_per_node = 8;
  membership m(o);
  EXPECT_TRUE(m.admit(reg("a", 8), t0()).accepted);
  auto a = m.admit(reg("huge", 2147483647), t0());
  EXPECT_FALSE(a.accepted);
  EXPECT_EQ(a.reason, "node 'huge' registered with nproc 2147483647, more than cluster.max_ranks_per_node (8); start it with fewer ranks "
                      "(--nproc-per-node) or raise the limit");
  EXPECT_EQ(m.find(node_id{"huge"}), nullptr);
  EXPECT_EQ(m.state().nodes.size(), 1u);
}

// Node ids reach log lines, progress lines, metric labels and file names:
// an id with terminal escapes, newlines or odd bytes is refused at the door,
// and the reason shows it printably.
TEST(membership, a_node_id_outside_the_id_alphabet_is_refused_printably) {
  membership m(opts(1));
  for (const std::string& ok : std::vector<std::string>{"ip-10-0-3-17", "gpu_node.7", "local-0", std::string(128, 'a')}) {
    EXPECT_EQ(node_id_problem(ok), "") << ok;
    EXPECT_TRUE(m.admit(reg(ok, 1), t0()).accepted) << ok;
  }
  const std::string escape = "evil\x1b[2J\nnode";
  auto a = m.admit(reg(escape, 1), t0());
  EXPECT_FALSE(a.accepted);
  EXPECT_EQ(a.reason, "register_node refused: node id 'evil\\x1b[2J\\x0anode' is not 1 to 128 letters, digits, '.', '_' or '-'");
  for (char c : a.reason) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << "unprintable byte in the reason";
  EXPECT_FALSE(m.admit(reg(std::string(129, 'a'), 1), t0()).accepted);
  EXPECT_FALSE(m.admit(reg("a b", 1), t0()).accepted);
  EXPECT_FALSE(m.admit(reg("caf\xc3\xa9", 1), t0()).accepted);
  EXPECT_EQ(m.find(node_id{escape}), nullptr);
}
