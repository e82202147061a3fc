// The coordinator's membership (actors/membership.hpp) as a pure object:
// admission, ranks, planning, settling, drains and quarantine.
#include <gtest/gtest.h>

#include "membership_test_util.hpp"

using namespace dtactor;
using namespace dtactor::membership_test;
using namespace std::chrono_literals;

TEST(membership, waits_for_min_nodes_with_a_readable_reason) {
  membership m(opts(2));
  EXPECT_EQ(m.decide(t0()).reason, "waiting for 2 nodes (cluster.min_nodes), have 0");
  ASSERT_TRUE(m.admit(reg("a"), t0()).accepted);
  auto d = m.decide(t0());
  EXPECT_FALSE(d.next);
  EXPECT_EQ(d.reason, "waiting for 2 nodes (cluster.min_nodes), have 1 [a]");
}

// A cold start of thousands of nodes: the reason, logged whenever it
// changes (at each registration), names a few nodes and counts the rest,
// so that its length does not grow with the nodes.
TEST(membership, a_waiting_reason_names_a_few_nodes_and_counts_the_rest) {
  membership m(opts(100, 1000));
  for (int i = 0; i < 40; ++i) ASSERT_TRUE(m.admit(reg("n" + std::to_string(100 + i)), t0()).accepted);
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(m.admit(cold("c" + std::to_string(100 + i)), t0()).accepted);
  const auto reason = m.decide(t0()).reason;
  EXPECT_EQ(reason.rfind("waiting for 100 nodes (cluster.min_nodes), have 40 [n100, n101, ", 0), 0u) << reason;
  EXPECT_NE(reason.find(", n115, ... (24 more)]; no ready rank yet: [c100, "), std::string::npos) << reason;
  EXPECT_NE(reason.find(", c115, ... (4 more)]"), std::string::npos) << reason;
  EXPECT_EQ(reason.find("n116"), std::string::npos) << reason;
}

// A resumed job (its checkpoint store holds commits of generation 5): its
// generations go on from 6, still behind the start gate, caused by a start;
// the plans after it count on from there.
TEST(membership, a_resumed_job_numbers_its_generations_above_the_earlier_runs) {
  auto o = opts(2);
  o.generations_after = 5;
  membership m(o);
  m.admit(reg("a"), t0());
  auto waiting = m.decide(t0());
  EXPECT_FALSE(waiting.next);
  EXPECT_EQ(waiting.reason, "waiting for 2 nodes (cluster.min_nodes), have 1 [a]");
  m.admit(reg("b"), t0());
  auto first = m.decide(t0());
  ASSERT_TRUE(first.next);
  EXPECT_EQ(first.next->generation, 6u);
  EXPECT_EQ(first.next->cause, plan_cause::start);
  EXPECT_EQ(first.next->state_root, -1);
  trained(m, *first.next);
  EXPECT_TRUE(m.remove(node_id{"b"}, t0() + 1s));
  auto next = m.decide(t0() + 1s);
  ASSERT_TRUE(next.next);
  EXPECT_EQ(next.next->generation, 7u);
}

TEST(membership, plan_orders_global_ranks_by_node_rank_then_local_rank) {
  membership m(opts(2));
  auto a = m.admit(reg("zeta", 2), t0());
  auto b = m.admit(reg("alpha", 3), t0());
  EXPECT_EQ(a.node_rank, 0);  // first come, first ranked (not alphabetical)
  EXPECT_EQ(b.node_rank, 1);
  auto d = m.decide(t0());
  ASSERT_TRUE(d.next) << d.reason;
  const auto& p = *d.next;
  EXPECT_EQ(p.generation, 1u);
  EXPECT_EQ(p.world_size, 5);
  EXPECT_EQ(p.state_root, -1);
  ASSERT_EQ(p.nodes.size(), 2u);
  EXPECT_EQ(p.nodes[0].node_id.str(), "zeta");
  EXPECT_EQ(p.nodes[1].node_id.str(), "alpha");
  EXPECT_EQ(p.nodes[1].first_global_rank, 2);
  ASSERT_EQ(p.ranks.size(), 5u);
  for (int32_t g = 0; g < 5; ++g) EXPECT_EQ(p.ranks[g].global_rank, g);
  EXPECT_EQ(p.ranks[1].node_id.str(), "zeta");
  EXPECT_EQ(p.ranks[1].local_rank, 1);
  EXPECT_EQ(p.ranks[2].node_id.str(), "alpha");
  EXPECT_EQ(p.ranks[2].local_rank, 0);
  EXPECT_NE(d.reason.find("generation 1: 2 nodes [alpha, zeta], world size 5"), std::string::npos) << d.reason;
}

TEST(membership, no_new_generation_without_a_change_and_one_per_change) {
  membership m(opts(1));
  m.admit(reg("a"), t0());
  trained(m, *m.decide(t0()).next);
  auto same = m.decide(t0() + 1s);
  EXPECT_FALSE(same.next);
  EXPECT_EQ(same.reason, "generation 1 is current: 1 node, world size 2");
  // A retried register (same incarnation) changes nothing.
  auto again = m.admit(reg("a"), t0() + 1s);
  EXPECT_TRUE(again.accepted);
  EXPECT_FALSE(again.changed);
  EXPECT_FALSE(m.decide(t0() + 1s).next);
  // Join -> generation 2; leave -> generation 3.
  m.admit(reg("b"), t0() + 2s);
  auto g2 = trained(m, *m.decide(t0() + 2s).next);
  EXPECT_EQ(g2.generation, 2u);
  EXPECT_EQ(g2.world_size, 4);
  EXPECT_EQ(g2.state_root, 0);  // a survived and holds global rank 0
  EXPECT_TRUE(m.remove(node_id{"b"}, t0() + 3s));
  EXPECT_FALSE(m.remove(node_id{"b"}, t0() + 3s));
  auto g3 = trained(m, *m.decide(t0() + 3s).next);
  EXPECT_EQ(g3.generation, 3u);
  EXPECT_EQ(g3.world_size, 2);
}

TEST(membership, a_restarted_node_keeps_its_rank_but_starts_a_generation_without_state) {
  membership m(opts(1));
  m.admit(reg("a", 1, 1), t0());
  m.admit(reg("b", 1, 1), t0());
  trained(m, *m.decide(t0()).next);
  auto r = m.admit(reg("a", 1, 2), t0() + 1s);  // same id, new process
  EXPECT_TRUE(r.accepted);
  EXPECT_TRUE(r.changed);
  EXPECT_EQ(r.node_rank, 0);
  auto p = *m.decide(t0() + 1s).next;
  EXPECT_EQ(p.generation, 2u);
  EXPECT_EQ(p.state_root, 1);  // b (global rank 1) is the only survivor
}

TEST(membership, a_returning_node_gets_its_old_rank_when_free) {
  membership m(opts(1));
  m.admit(reg("a"), t0());
  m.admit(reg("b"), t0());
  m.admit(reg("c"), t0());
  m.remove(node_id{"b"}, t0() + 1s);
  // A newcomer does not take b's remembered rank while another is free.
  EXPECT_EQ(m.admit(reg("d"), t0() + 2s).node_rank, 3);
  auto back = m.admit(reg("b", 2, 7), t0() + 3s);
  EXPECT_TRUE(back.accepted);
  EXPECT_TRUE(back.rejoined);
  EXPECT_EQ(back.node_rank, 1);
}

TEST(membership, remembered_ranks_yield_when_only_they_are_free_below_max_nodes) {
  membership m(opts(1, 2));
  m.admit(reg("a"), t0());
  m.admit(reg("b"), t0());
  m.remove(node_id{"b"}, t0());
  auto c = m.admit(reg("c"), t0());
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_FALSE(c.rejoined);
  m.remove(node_id{"a"}, t0());
  auto b = m.admit(reg("b"), t0());  // its rank 1 is held by c now
  EXPECT_EQ(b.node_rank, 0);
}

TEST(rank_use, finds_the_lowest_free_rank_and_the_next_ones) {
  rank_use u;
  EXPECT_EQ(u.lowest_free(), 0);
  for (int32_t r : {0, 1, 2, 4}) u.add(r);
  EXPECT_EQ(u.lowest_free(), 3);
  EXPECT_EQ(u.free_after(3), 5);
  EXPECT_EQ(u.free_after(7), 8);
  u.add(1);  // two members on one rank (an adopted plan's order moves them)
  u.remove(1);
  EXPECT_TRUE(u.held(1));
  u.remove(1);
  EXPECT_FALSE(u.held(1));
  EXPECT_EQ(u.lowest_free(), 1);
  EXPECT_EQ(u.free_after(1), 3);
  u.remove(9);  // never held: nothing
  EXPECT_EQ(u.free_after(4), 5);
  u.clear();
  EXPECT_EQ(u.lowest_free(), 0);
}

// Ranks freed by losses, restarts and leaves are found again: every member
// has its own rank, and newcomers take the lowest free ones no departed
// node remembers.
TEST(membership, ranks_stay_distinct_through_losses_restarts_and_rejoins) {
  membership m(opts(1, 64));
  for (int i = 0; i < 10; ++i) ASSERT_EQ(m.admit(reg("n" + std::to_string(i)), t0()).node_rank, i);
  m.remove(node_id{"n3"}, t0() + 1s);
  m.remove(node_id{"n7"}, t0() + 1s, departure::left);
  EXPECT_EQ(m.admit(reg("n5", 2, 2), t0() + 5s).node_rank, 5);  // a restart keeps its rank
  EXPECT_EQ(m.admit(reg("x"), t0() + 5s).node_rank, 10);       // 3 and 7 are remembered
  EXPECT_EQ(m.admit(reg("n7"), t0() + 5s).node_rank, 7);
  m.remove(node_id{"x"}, t0() + 6s);
  EXPECT_EQ(m.admit(reg("y"), t0() + 6s).node_rank, 11);
  std::set<int32_t> ranks;
  for (const auto& [id, n] : m.state().nodes) EXPECT_TRUE(ranks.insert(n.node_rank).second) << id.str();
  EXPECT_EQ(ranks.size(), m.state().nodes.size());
}

TEST(membership, refuses_beyond_max_nodes_with_a_reason) {
  membership m(opts(1, 2));
  EXPECT_TRUE(m.admit(reg("a"), t0()).accepted);
  EXPECT_TRUE(m.admit(reg("b"), t0()).accepted);
  auto c = m.admit(reg("c"), t0());
  EXPECT_FALSE(c.accepted);
  EXPECT_EQ(c.node_rank, -1);
  EXPECT_EQ(c.reason,
            "cluster is full: 2 nodes are members and cluster.max_nodes is 2; node 'c' was not admitted (raise cluster.max_nodes or stop a node)");
  EXPECT_EQ(m.state().nodes.size(), 2u);
  EXPECT_TRUE(m.admit(reg("a"), t0()).accepted);  // members may re-register
}

TEST(membership, refuses_malformed_registrations) {
  membership m;
  EXPECT_FALSE(m.admit(reg(""), t0()).accepted);
  auto z = m.admit(reg("a", 0), t0());
  EXPECT_FALSE(z.accepted);
  EXPECT_NE(z.reason.find("at least one rank"), std::string::npos);
}

TEST(membership, touch_only_counts_for_members_of_the_same_incarnation) {
  membership m;
  m.admit(reg("a", 1, 5), t0());
  EXPECT_TRUE(m.touch(node_id{"a"}, 5, t0() + 1s, "peer-new"));
  EXPECT_EQ(m.last_seen().at(node_id{"a"}), t0() + 1s);
  EXPECT_EQ(m.find(node_id{"a"})->peer, "peer-new");
  EXPECT_FALSE(m.touch(node_id{"a"}, 4, t0() + 2s));
  EXPECT_FALSE(m.touch(node_id{"x"}, 5, t0() + 2s));
  EXPECT_EQ(m.last_seen().at(node_id{"a"}), t0() + 1s);
}

TEST(membership, settle_batches_arrivals_unless_the_cluster_is_full) {
  auto o = opts(1, 3);
  o.settle = 500ms;
  membership m(o);
  m.admit(reg("a"), t0());
  auto d = m.decide(t0() + 100ms);
  EXPECT_FALSE(d.next);
  EXPECT_NE(d.reason.find("settling"), std::string::npos) << d.reason;
  m.admit(reg("b"), t0() + 300ms);
  EXPECT_FALSE(m.decide(t0() + 700ms).next);
  EXPECT_EQ(m.decide(t0() + 800ms).next->world_size, 4);
  m.admit(reg("c"), t0() + 900ms);  // full: no need to wait
  EXPECT_EQ(m.decide(t0() + 900ms).next->world_size, 6);
}

TEST(membership, decide_is_pure) {
  membership m(opts(1));
  m.admit(reg("a"), t0());
  auto d1 = decide(t0(), m.state(), m.options());
  auto d2 = decide(t0(), m.state(), m.options());
  EXPECT_EQ(d1.reason, d2.reason);
  EXPECT_EQ(d1.next->generation, d2.next->generation);
  EXPECT_EQ(m.state().last_generation, 0u);
}

TEST(membership, options_from_config_keys) {
  const std::map<std::string, std::string> keys{{"cluster.min_nodes", "3"},
                                                {"cluster.floor_nodes", "2"},
                                                {"cluster.heartbeat_interval_ms", "120"},
                                                {"cluster.max_nodes", "5"},
                                                {"cluster.max_ranks_per_node", "12"},
                                                {"cluster.settle_ms", "250"},
                                                {"cluster.suspect_timeout_ms", "400"},
                                                {"cluster.heartbeat_timeout_ms", "900"},
                                                {"cluster.flap_max_failures", "4"},
                                                {"cluster.flap_window_ms", "30000"},
                                                {"cluster.quarantine_ms", "7000"}};
  config cfg;
  for (const auto& [k, v] : keys) ASSERT_TRUE(cfg.set(k, v)) << k;
  auto cluster = cluster_settings_of(cfg);
  ASSERT_TRUE(cluster) << cluster.message();
  auto o = membership_options_from(cluster.value());
  EXPECT_EQ(o.min_nodes, 3);
  EXPECT_EQ(o.floor_nodes, 2);
  EXPECT_EQ(o.duplicate_window, 360ms);
  EXPECT_EQ(validate(o), "");
  o.floor_nodes = 4;
  EXPECT_NE(validate(o).find("cluster.floor_nodes (4) cannot exceed cluster.min_nodes (3)"), std::string::npos) << validate(o);
  o.floor_nodes = 2;
  EXPECT_EQ(o.max_nodes, 5);
  EXPECT_EQ(o.max_ranks_per_node, 12);
  EXPECT_EQ(o.settle, 250ms);
  EXPECT_EQ(o.suspect_timeout, 400ms);
  EXPECT_EQ(o.adopt_timeout, 1800ms);
  EXPECT_EQ(o.flap_max_failures, 4);
  EXPECT_EQ(o.flap_window, 30s);
  EXPECT_EQ(o.quarantine, 7s);
}

// -- per-rank readiness --------------------------------------------------------

TEST(membership, only_ready_ranks_are_planned_and_quorum_counts_nodes_with_one) {
  membership m(opts(2));
  m.admit(cold("a", 3), t0());
  m.admit(cold("b", 2), t0());
  auto d = m.decide(t0());
  EXPECT_FALSE(d.next);
  EXPECT_EQ(d.reason, "waiting for 2 nodes (cluster.min_nodes), have 0; no ready rank yet: [a, b]");
  EXPECT_TRUE(m.set_rank_ready(node_id{"a"}, 1, 2, true, t0()));
  EXPECT_TRUE(m.set_rank_ready(node_id{"a"}, 1, 0, true, t0()));
  EXPECT_FALSE(m.set_rank_ready(node_id{"a"}, 1, 0, true, t0()));  // no change
  EXPECT_FALSE(m.set_rank_ready(node_id{"a"}, 2, 1, true, t0()));  // another incarnation
  EXPECT_FALSE(m.set_rank_ready(node_id{"a"}, 1, 3, true, t0()));  // no such local rank
  EXPECT_FALSE(m.set_rank_ready(node_id{"x"}, 1, 0, true, t0()));
  EXPECT_EQ(m.decide(t0()).reason, "waiting for 2 nodes (cluster.min_nodes), have 1 [a]; no ready rank yet: [b]");
  EXPECT_TRUE(m.set_rank_ready(node_id{"b"}, 1, 1, true, t0()));
  auto p = *m.decide(t0()).next;
  EXPECT_EQ(p.world_size, 3);
  ASSERT_EQ(p.ranks.size(), 3u);
  EXPECT_EQ(p.ranks[0].node_id.str(), "a");
  EXPECT_EQ(p.ranks[0].local_rank, 0);
  EXPECT_EQ(p.ranks[1].local_rank, 2);  // the real local rank, the next global rank
  EXPECT_EQ(p.ranks[1].global_rank, 1);
  EXPECT_EQ(p.ranks[2].node_id.str(), "b");
  EXPECT_EQ(p.ranks[2].local_rank, 1);
  EXPECT_EQ(p.ranks[2].global_rank, 2);
  EXPECT_EQ(p.nodes[1].first_global_rank, 2);
  EXPECT_EQ(p.nodes[0].local_ranks, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(p.nodes[0].nproc, 3);
  EXPECT_EQ(p.cause, plan_cause::start);
  EXPECT_FALSE(p.drain);
}

TEST(membership, a_node_without_a_ready_rank_is_a_member_but_not_planned) {
  membership m(opts(1));
  m.admit(reg("a", 1), t0());
  trained(m, *m.decide(t0()).next);
  EXPECT_TRUE(m.admit(cold("b", 1), t0() + 1s).accepted);
  auto d = m.decide(t0() + 1s);
  EXPECT_FALSE(d.next) << d.reason;  // nothing to plan yet: b's rank is not ready
  m.set_rank_ready(node_id{"b"}, 1, 0, true, t0() + 2s);
  auto p = *m.decide(t0() + 2s).next;
  EXPECT_EQ(p.world_size, 2);
  EXPECT_EQ(p.cause, plan_cause::node_joined);  // its first ready rank is its join
  EXPECT_TRUE(p.drain);
}

TEST(membership, a_planned_rank_that_exited_aborts_and_its_return_is_a_new_rank) {
  membership m(opts(1));
  m.admit(reg("a", 2), t0());
  trained(m, *m.decide(t0()).next);
  EXPECT_TRUE(m.set_rank_ready(node_id{"a"}, 1, 0, false, t0() + 1s));
  auto g2 = trained(m, *m.decide(t0() + 1s).next);
  EXPECT_EQ(g2.world_size, 1);
  EXPECT_EQ(g2.ranks[0].local_rank, 1);
  EXPECT_EQ(g2.cause, plan_cause::rank_exited);
  EXPECT_FALSE(g2.drain);
  EXPECT_EQ(g2.state_root, 0);  // local rank 1 survived
  // Back (a restarted process): planned again, without state, and it drains.
  m.set_rank_ready(node_id{"a"}, 1, 0, true, t0() + 2s);
  auto g3 = trained(m, *m.decide(t0() + 2s).next);
  EXPECT_EQ(g3.world_size, 2);
  EXPECT_EQ(g3.cause, plan_cause::rank_ready);
  EXPECT_TRUE(g3.drain);
  EXPECT_EQ(g3.state_root, 1);  // global rank 1 is local rank 1, the survivor
}

TEST(membership, a_rank_that_exits_and_returns_between_decisions_is_still_a_change) {
  membership m(opts(1));
  m.admit(reg("a", 2), t0());
  trained(m, *m.decide(t0()).next);
  m.set_rank_ready(node_id{"a"}, 1, 0, false, t0() + 1s);
  m.set_rank_ready(node_id{"a"}, 1, 0, true, t0() + 1s);
  auto d = m.decide(t0() + 1s);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(d.next->cause, plan_cause::rank_exited);
  EXPECT_FALSE(d.next->drain);
  EXPECT_EQ(d.next->state_root, 1);  // not the restarted local rank 0
}

TEST(membership, registration_ready_ranks_replace_the_ready_set) {
  membership m(opts(1));
  m.admit(reg("a", 2), t0());
  trained(m, *m.decide(t0()).next);
  auto r = reg("a", 2);
  r.ready_ranks = {1};
  auto a = m.admit(r, t0() + 1s);  // same process, reconnected: rank 0 is gone
  EXPECT_TRUE(a.changed);
  EXPECT_FALSE(a.joined);
  EXPECT_EQ(m.find(node_id{"a"})->ready.size(), 1u);
  EXPECT_EQ(m.decide(t0() + 1s).next->cause, plan_cause::rank_exited);
}

// -- settling --------------------------------------------------------------------

TEST(membership, the_first_generation_and_joins_settle_from_the_last_addition) {
  auto o = opts(1, 4);
  o.settle = 300ms;
  membership m(o);
  m.admit(cold("a", 2), t0());
  m.set_rank_ready(node_id{"a"}, 1, 0, true, t0() + 100ms);
  EXPECT_FALSE(m.decide(t0() + 350ms).next);  // settles from the rank, not the join
  m.set_rank_ready(node_id{"a"}, 1, 1, true, t0() + 350ms);
  EXPECT_FALSE(m.decide(t0() + 600ms).next);
  auto g1 = trained(m, *m.decide(t0() + 650ms).next);
  EXPECT_EQ(g1.world_size, 2);
  m.admit(reg("b", 2), t0() + 1s);
  auto d = m.decide(t0() + 1200ms);
  EXPECT_FALSE(d.next);
  EXPECT_NE(d.reason.find("settling for 0.3 s"), std::string::npos) << d.reason;
  EXPECT_EQ(m.decide(t0() + 1300ms).next->world_size, 4);
}

TEST(membership, a_loss_does_not_settle_and_takes_whatever_is_ready) {
  auto o = opts(1);
  o.settle = 300ms;
  membership m(o);
  m.admit(reg("a", 1), t0());
  m.admit(reg("b", 1), t0());
  trained(m, *m.decide(t0() + 300ms).next);
  m.admit(reg("c", 1), t0() + 1s);  // settling until 1.3 s
  EXPECT_FALSE(m.decide(t0() + 1100ms).next);
  EXPECT_TRUE(m.remove(node_id{"b"}, t0() + 1100ms));
  m.admit(reg("d", 1), t0() + 1150ms);  // an addition after the loss does not delay it
  auto p = *m.decide(t0() + 1150ms).next;
  EXPECT_EQ(p.cause, plan_cause::node_lost);
  EXPECT_FALSE(p.drain);
  EXPECT_EQ(p.world_size, 3);  // a, c and d
}

TEST(membership, a_loss_outside_the_plan_does_not_cut_settling_short) {
  auto o = opts(1);
  o.settle = 300ms;
  membership m(o);
  m.admit(reg("a", 1), t0());
  trained(m, *m.decide(t0() + 300ms).next);
  m.admit(reg("b", 1), t0() + 1s);
  m.admit(cold("c", 1), t0() + 1s);
  EXPECT_TRUE(m.remove(node_id{"c"}, t0() + 1100ms));  // never planned
  EXPECT_FALSE(m.decide(t0() + 1100ms).next);
  EXPECT_EQ(m.decide(t0() + 1300ms).next->cause, plan_cause::node_joined);
}

TEST(membership, a_full_cluster_does_not_settle) {
  auto o = opts(1, 2);
  o.settle = 1s;
  membership m(o);
  m.admit(reg("a", 1), t0());
  m.admit(cold("b", 2), t0());
  m.set_rank_ready(node_id{"b"}, 1, 0, true, t0());
  EXPECT_FALSE(m.decide(t0()).next);  // b's rank 1 is not up: not full yet
  m.set_rank_ready(node_id{"b"}, 1, 1, true, t0());
  EXPECT_EQ(m.decide(t0()).next->world_size, 3);
}

// -- drain vs abort, leave ---------------------------------------------------------

TEST(membership, a_join_drains_and_a_loss_aborts) {
  membership m(opts(1));
  m.admit(reg("a", 1), t0());
  trained(m, *m.decide(t0()).next);
  m.admit(reg("b", 1), t0() + 1s);
  auto g2 = trained(m, *m.decide(t0() + 1s).next);
  EXPECT_EQ(g2.cause, plan_cause::node_joined);
  EXPECT_TRUE(g2.drain);
  m.remove(node_id{"a"}, t0() + 2s);
  auto g3 = trained(m, *m.decide(t0() + 2s).next);
  EXPECT_EQ(g3.cause, plan_cause::node_lost);
  EXPECT_FALSE(g3.drain);
  EXPECT_EQ(g3.state_root, 0);
}

// Found by the chaos tests under load: b was planned in with a (who alone
// held the state) and a died before b's agreement; b is no state root, so
// the next plan carries the newest checkpoint instead of b's empty state.
TEST(membership, a_rank_planned_in_but_never_ready_is_no_state_root) {
  membership m(opts(1));
  m.admit(reg("a", 1), t0());
  trained(m, *m.decide(t0()).next);
  m.admit(reg("b", 1), t0() + 1s);
  m.commit(*m.decide(t0() + 1s).next);  // generation 2: nobody reported READY in it yet
  m.remove(node_id{"a"}, t0() + 2s);
  auto g3 = m.commit(*m.decide(t0() + 2s).next);
  EXPECT_EQ(g3.state_root, -1);
  // Had b reported READY in generation 2, it would hold the state.
  membership m2(opts(1));
  m2.admit(reg("a", 1), t0());
  trained(m2, *m2.decide(t0()).next);
  m2.admit(reg("b", 1), t0() + 1s);
  const auto g2 = m2.commit(*m2.decide(t0() + 1s).next);
  m2.note_synced(node_id{"b"}, 1, 0, g2.generation);
  m2.remove(node_id{"a"}, t0() + 2s);
  EXPECT_EQ(m2.commit(*m2.decide(t0() + 2s).next).state_root, 0);
}

TEST(membership, a_leave_drains_and_the_plan_goes_to_the_leaving_node_too) {
  membership m(opts(1));
  m.admit(reg("a", 1), t0());
  m.admit(reg("b", 2), t0());
  trained(m, *m.decide(t0()).next);
  EXPECT_TRUE(m.remove(node_id{"b"}, t0() + 1s, departure::left));
  auto p = trained(m, *m.decide(t0() + 1s).next);
  EXPECT_EQ(p.cause, plan_cause::node_left);
  EXPECT_TRUE(p.drain);
  EXPECT_EQ(p.world_size, 1);
  ASSERT_EQ(p.leaving.size(), 1u);
  EXPECT_EQ(p.leaving[0].node_id.str(), "b");
  EXPECT_EQ(p.leaving[0].peer, "peer-b");
  EXPECT_EQ(m.state().remembered_ranks.at(node_id{"b"}), 1);
  EXPECT_TRUE(m.state().flaps.empty());  // a clean leave is no failure
  // The next plan is not sent to b again.
  m.admit(reg("c", 1), t0() + 2s);
  EXPECT_TRUE(m.decide(t0() + 2s).next->leaving.empty());
}

TEST(membership, a_leave_with_a_loss_aborts_and_the_loss_names_it) {
  membership m(opts(1));
  m.admit(reg("a", 1), t0());
  m.admit(reg("b", 1), t0());
  m.admit(reg("c", 1), t0());
  trained(m, *m.decide(t0()).next);
  m.remove(node_id{"b"}, t0() + 1s, departure::left);
  m.remove(node_id{"c"}, t0() + 1s);
  auto p = *m.decide(t0() + 1s).next;
  EXPECT_EQ(p.cause, plan_cause::node_lost);
  EXPECT_FALSE(p.drain);
  EXPECT_EQ(p.leaving.size(), 1u);
}

// -- suspicion after a failed collective -------------------------------------------

TEST(membership, a_failed_collective_with_no_change_forces_a_generation_after_the_suspect_timeout) {
  auto o = opts(1);
  o.suspect_timeout = 300ms;
  membership m(o);
  m.admit(reg("a", 1), t0());
  m.admit(reg("b", 1), t0());
  trained(m, *m.decide(t0()).next);
  EXPECT_FALSE(m.report_failure(0, node_id{"a"}, 0, t0() + 1s));  // an older generation
  EXPECT_FALSE(m.report_failure(1, node_id{"a"}, 1, t0() + 1s));  // not a rank of the plan
  EXPECT_FALSE(m.suspecting());
  EXPECT_TRUE(m.report_failure(1, node_id{"a"}, 0, t0() + 1s));
  EXPECT_FALSE(m.report_failure(1, node_id{"b"}, 0, t0() + 1100ms));  // already suspecting: the first report counts
  EXPECT_TRUE(m.suspecting());
  auto d = m.decide(t0() + 1299ms);
  EXPECT_FALSE(d.next);
  EXPECT_NE(d.reason.find("a collective failed"), std::string::npos) << d.reason;
  auto p = trained(m, *m.decide(t0() + 1300ms).next);
  EXPECT_EQ(p.generation, 2u);
  EXPECT_EQ(p.world_size, 2);
  EXPECT_EQ(p.cause, plan_cause::collective_failure);
  EXPECT_FALSE(p.drain);
  EXPECT_EQ(p.state_root, 0);
  EXPECT_FALSE(m.suspecting());
  EXPECT_FALSE(m.decide(t0() + 5s).next);
}

TEST(membership, while_suspecting_a_join_does_not_drain) {
  auto o = opts(1);
  membership m(o);
  m.admit(reg("a", 1), t0());
  trained(m, *m.decide(t0()).next);
  m.report_failure(1, node_id{"a"}, 0, t0() + 1s);
  m.admit(reg("b", 1), t0() + 1s);
  auto p = *m.decide(t0() + 1s).next;
  EXPECT_EQ(p.cause, plan_cause::node_joined);
  EXPECT_FALSE(p.drain);
}

// -- quarantine ------------------------------------------------------------------------

TEST(membership, a_node_lost_too_often_is_quarantined_with_doubling_length) {
  auto o = opts(1);
  o.flap_max_failures = 3;
  o.flap_window = 60s;
  o.quarantine = 10s;
  membership m(o);
  auto t = t0();
  auto lose = [&](clock_time at) {
    EXPECT_TRUE(m.admit(reg("a"), at).accepted);
    return m.remove(node_id{"a"}, at);
  };
  EXPECT_FALSE(lose(t).quarantined);
  EXPECT_FALSE(lose(t + 20s).quarantined);
  auto third = lose(t + 40s);
  EXPECT_TRUE(third.quarantined);
  EXPECT_EQ(third.reason, "node 'a' is quarantined for 10 s after 3 failures in 60 s (flapping)");
  auto refused = m.admit(reg("a"), t + 45s);
  EXPECT_FALSE(refused.accepted);
  EXPECT_TRUE(refused.quarantined);
  EXPECT_EQ(refused.reason, "node 'a' is quarantined for 10 s after 3 failures in 60 s (flapping); 5 s left");
  EXPECT_EQ(m.find(node_id{"a"}), nullptr);
  // After it, a fresh count; the second quarantine lasts twice as long.
  EXPECT_FALSE(lose(t + 50s).quarantined);
  EXPECT_FALSE(lose(t + 51s).quarantined);
  auto again = lose(t + 52s);
  EXPECT_TRUE(again.quarantined);
  EXPECT_EQ(m.quarantine_reason(node_id{"a"}, t + 52s), "node 'a' is quarantined for 20 s after 3 failures in 60 s (flapping); 20 s left");
  EXPECT_FALSE(m.admit(reg("a"), t + 71s).accepted);
  EXPECT_TRUE(m.admit(reg("a"), t + 72s).accepted);
  EXPECT_TRUE(m.quarantine_reason(node_id{"a"}, t + 72s).empty());
}

TEST(membership, failures_outside_the_window_do_not_count) {
  auto o = opts(1);
  o.flap_max_failures = 2;
  o.flap_window = 10s;
  membership m(o);
  m.admit(reg("a"), t0());
  EXPECT_FALSE(m.remove(node_id{"a"}, t0()).quarantined);
  m.admit(reg("a"), t0() + 10s);
  EXPECT_FALSE(m.remove(node_id{"a"}, t0() + 10s).quarantined);  // the first is 10 s old: out
  m.admit(reg("a"), t0() + 12s);
  EXPECT_TRUE(m.remove(node_id{"a"}, t0() + 12s).quarantined);
}

TEST(membership, quarantine_length_is_capped_at_five_minutes) {
  auto o = opts(1);
  o.flap_max_failures = 1;
  o.quarantine = 100s;
  membership m(o);
  auto t = t0();
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(m.admit(reg("a"), t).accepted) << i;
    ASSERT_TRUE(m.remove(node_id{"a"}, t).quarantined);
    t += 1h;
  }
  EXPECT_EQ(m.state().flaps.at(node_id{"a"}).quarantines, 4);
  EXPECT_EQ(*m.state().flaps.at(node_id{"a"}).until - (t - 1h), 300s);  // 100, 200, 300, 300
}

TEST(membership, a_member_restarting_counts_as_a_failure_and_can_be_quarantined) {
  auto o = opts(1);
  o.flap_max_failures = 2;
  membership m(o);
  m.admit(reg("a", 1, 1), t0());
  m.admit(reg("b", 1, 1), t0());
  trained(m, *m.decide(t0()).next);
  auto r1 = m.admit(reg("a", 1, 2), t0() + 1500ms);
  EXPECT_TRUE(r1.accepted);
  EXPECT_TRUE(r1.restarted);
  EXPECT_TRUE(r1.joined);
  EXPECT_DOUBLE_EQ(r1.silent_s, 1.5);
  auto p = trained(m, *m.decide(t0() + 2s).next);
  EXPECT_EQ(p.cause, plan_cause::node_lost);
  EXPECT_FALSE(p.drain);
  auto r2 = m.admit(reg("a", 1, 3), t0() + 3s);
  EXPECT_FALSE(r2.accepted);
  EXPECT_TRUE(r2.quarantined);
  EXPECT_TRUE(r2.restarted);
  EXPECT_NE(r2.reason.find("after 2 failures"), std::string::npos) << r2.reason;
  EXPECT_EQ(m.find(node_id{"a"}), nullptr);  // removed
  EXPECT_EQ(m.decide(t0() + 3s).next->world_size, 1);
}
