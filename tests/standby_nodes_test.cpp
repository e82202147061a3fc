// Standby nodes (cluster.standby_nodes) in the membership's pure decision:
// nodes admitted beyond cluster.max_nodes wait outside the world, and the
// re-plan that drops a lost member plans the first of them in, at once (no
// settling), so that the world keeps its size. The clock is a value.
#include "actors/membership.hpp"

#include <gtest/gtest.h>

using namespace dtactor;
using namespace std::chrono_literals;

namespace {

clock_time t0() { return clock_time{} + 1h; }

// A node whose `nproc` ranks are all up and warmed.
node_registration warm(const std::string& id, int32_t nproc = 2, uint64_t incarnation = 1) {
  std::vector<int32_t> ready;
  for (int32_t l = 0; l < nproc; ++l) ready.push_back(l);
  return node_registration{node_id{id}, id + ".local", nproc, incarnation, "peer-" + id, ready, 0, std::nullopt};
}

// A world of two nodes with one standby; settling long enough that a plan
// made after a join before it ends can only be a loss's.
membership_options two_and_a_standby() {
  membership_options o;
  o.min_nodes = 2;
  o.max_nodes = 2;
  o.standby_nodes = 1;
  o.settle = 10min;
  return o;
}

std::vector<std::string> ids(const plan& p) {
  std::vector<std::string> out;
  for (const auto& n : p.nodes) out.push_back(n.node_id.str());
  return out;
}

std::vector<std::string> strs(const std::vector<node_id>& xs) {
  std::vector<std::string> out;
  for (const auto& x : xs) out.push_back(x.str());
  return out;
}

// Commits `p` and has each of its ranks report READY in it (it trained).
void trained(membership& m, plan p) {
  const auto& c = m.commit(std::move(p));
  for (const auto& r : c.ranks) m.note_synced(r.node_id, m.find(r.node_id)->incarnation, r.local_rank, c.generation);
}

// a and b planned in generation 1 (trained), c admitted after them and
// waiting outside.
membership world_with_standby() {
  membership m(two_and_a_standby());
  EXPECT_TRUE(m.admit(warm("a"), t0()).accepted);
  EXPECT_TRUE(m.admit(warm("b"), t0()).accepted);
  auto first = m.decide(t0());  // full: no settling
  EXPECT_TRUE(first.next);
  if (first.next) trained(m, *first.next);
  EXPECT_TRUE(m.admit(warm("c"), t0() + 1s).accepted);
  return m;
}

}  // namespace

TEST(standby_nodes, a_node_beyond_max_nodes_is_admitted_and_waits_outside_the_world) {
  auto m = world_with_standby();
  ASSERT_NE(m.find(node_id{"c"}), nullptr);
  EXPECT_EQ(m.find(node_id{"c"})->ready.size(), 2u);
  auto d = m.decide(t0() + 2s);
  EXPECT_FALSE(d.next) << d.reason;
  EXPECT_EQ(d.reason, "generation 1 is current: 2 nodes, world size 4; 1 standby waiting");
  EXPECT_EQ(ids(*m.state().current), (std::vector<std::string>{"a", "b"}));
}

TEST(standby_nodes, a_members_loss_promotes_the_standby_in_the_same_plan_without_settling) {
  auto m = world_with_standby();
  ASSERT_TRUE(m.remove(node_id{"a"}, t0() + 2s));
  auto d = m.decide(t0() + 2s);  // no time passes: no settling
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(d.next->generation, 2u);
  EXPECT_EQ(d.next->world_size, 4);
  EXPECT_EQ(ids(*d.next), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(strs(d.next->promoted), (std::vector<std::string>{"c"}));
  EXPECT_EQ(d.next->cause, plan_cause::node_lost);
  EXPECT_FALSE(d.next->drain);
  EXPECT_EQ(d.next->state_root, 0);  // b's first rank holds generation 1's state
  EXPECT_NE(d.reason.find("standby promoted: [c]"), std::string::npos) << d.reason;
}

TEST(standby_nodes, a_member_keeps_its_place_over_a_standby_of_a_lower_node_rank) {
  auto m = world_with_standby();
  ASSERT_TRUE(m.remove(node_id{"a"}, t0() + 2s));
  auto promoted = m.decide(t0() + 2s);
  ASSERT_TRUE(promoted.next);
  trained(m, *promoted.next);
  // a comes back (its node rank 0 is free again): it waits as the standby
  // now; b and c are not interrupted.
  auto back = m.admit(warm("a", 2, 2), t0() + 3s);
  ASSERT_TRUE(back.accepted) << back.reason;
  EXPECT_EQ(back.node_rank, 0);
  auto d = m.decide(t0() + 20min);
  EXPECT_FALSE(d.next) << d.reason;
  EXPECT_EQ(ids(*m.state().current), (std::vector<std::string>{"b", "c"}));
}

TEST(standby_nodes, a_plan_below_max_nodes_promotes_nobody) {
  membership_options o = two_and_a_standby();
  o.min_nodes = 1;
  o.settle = 0ms;
  membership m(o);
  ASSERT_TRUE(m.admit(warm("a"), t0()).accepted);
  auto first = m.decide(t0());
  ASSERT_TRUE(first.next);
  trained(m, *first.next);
  ASSERT_TRUE(m.admit(warm("b"), t0() + 1s).accepted);
  auto grown = m.decide(t0() + 1s);
  ASSERT_TRUE(grown.next);
  EXPECT_EQ(ids(*grown.next), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(grown.next->promoted.empty());  // a join into room, not a standby
}

TEST(standby_nodes, registrations_beyond_the_standbys_are_refused_with_a_reason) {
  auto m = world_with_standby();
  auto d = m.admit(warm("d"), t0() + 2s);
  EXPECT_FALSE(d.accepted);
  EXPECT_EQ(d.reason,
            "cluster is full: 3 nodes are members and cluster.max_nodes is 2 and cluster.standby_nodes is 1; node 'd' was not admitted "
            "(raise cluster.max_nodes or stop a node)");
}

TEST(standby_nodes, the_setting_reaches_the_membership_options) {
  cluster_settings c;
  c.max_nodes = 2;
  c.standby_nodes = 3;
  EXPECT_EQ(membership_options_from(c).standby_nodes, 3);
}
