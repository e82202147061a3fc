#include "actors/membership.hpp"

#include <gtest/gtest.h>

using namespace dtactor;
using namespace std::chrono_literals;

namespace {

clock_time t0() { return clock_time{} + 1h; }

node_registration reg(const std::string& id, int32_t nproc = 2, uint64_t incarnation = 1) {
  return node_registration{id, id + ".local", nproc, incarnation, "peer-" + id};
}

membership_options opts(int32_t min_nodes, int32_t max_nodes = 64) {
  membership_options o;
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  return o;
}

}  // namespace

TEST(membership, waits_for_min_nodes_with_a_readable_reason) {
  membership m(opts(2));
  EXPECT_EQ(m.decide(t0()).reason, "waiting for 2 nodes (cluster.min_nodes), have 0");
  ASSERT_TRUE(m.admit(reg("a"), t0()).accepted);
  auto d = m.decide(t0());
  EXPECT_FALSE(d.next);
  EXPECT_EQ(d.reason, "waiting for 2 nodes (cluster.min_nodes), have 1 [a]");
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
  EXPECT_EQ(p.nodes[0].node_id, "zeta");
  EXPECT_EQ(p.nodes[1].node_id, "alpha");
  EXPECT_EQ(p.nodes[1].first_global_rank, 2);
  ASSERT_EQ(p.ranks.size(), 5u);
  for (int32_t g = 0; g < 5; ++g) EXPECT_EQ(p.ranks[g].global_rank, g);
  EXPECT_EQ(p.ranks[1].node_id, "zeta");
  EXPECT_EQ(p.ranks[1].local_rank, 1);
  EXPECT_EQ(p.ranks[2].node_id, "alpha");
  EXPECT_EQ(p.ranks[2].local_rank, 0);
  EXPECT_NE(d.reason.find("generation 1: 2 nodes [alpha, zeta], world size 5"), std::string::npos) << d.reason;
}

TEST(membership, no_new_generation_without_a_change_and_one_per_change) {
  membership m(opts(1));
  m.admit(reg("a"), t0());
  m.commit(*m.decide(t0()).next);
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
  auto g2 = m.commit(*m.decide(t0() + 2s).next);
  EXPECT_EQ(g2.generation, 2u);
  EXPECT_EQ(g2.world_size, 4);
  EXPECT_EQ(g2.state_root, 0);  // a survived and holds global rank 0
  EXPECT_TRUE(m.remove("b", t0() + 3s));
  EXPECT_FALSE(m.remove("b", t0() + 3s));
  auto g3 = m.commit(*m.decide(t0() + 3s).next);
  EXPECT_EQ(g3.generation, 3u);
  EXPECT_EQ(g3.world_size, 2);
}

TEST(membership, a_restarted_node_keeps_its_rank_but_starts_a_generation_without_state) {
  membership m(opts(1));
  m.admit(reg("a", 1, 1), t0());
  m.admit(reg("b", 1, 1), t0());
  m.commit(*m.decide(t0()).next);
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
  m.remove("b", t0() + 1s);
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
  m.remove("b", t0());
  auto c = m.admit(reg("c"), t0());
  EXPECT_EQ(c.node_rank, 1);
  EXPECT_FALSE(c.rejoined);
  m.remove("a", t0());
  auto b = m.admit(reg("b"), t0());  // its rank 1 is held by c now
  EXPECT_EQ(b.node_rank, 0);
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
  EXPECT_TRUE(m.touch("a", 5, t0() + 1s, "peer-new"));
  EXPECT_EQ(m.last_seen().at("a"), t0() + 1s);
  EXPECT_EQ(m.find("a")->peer, "peer-new");
  EXPECT_FALSE(m.touch("a", 4, t0() + 2s));
  EXPECT_FALSE(m.touch("x", 5, t0() + 2s));
  EXPECT_EQ(m.last_seen().at("a"), t0() + 1s);
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
  struct fake_config {
    int64_t get_int(const std::string& k) const { return k == "cluster.min_nodes" ? 3 : 5; }
  };
  auto o = membership_options_from(fake_config{});
  EXPECT_EQ(o.min_nodes, 3);
  EXPECT_EQ(o.max_nodes, 5);
}
