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

// Standby nodes by flag (--standby-node, register_node.standby): with
// cluster.standby_nodes at 0 and room in the world, such a node still waits
// outside it and is planned in only into a place a member left.
namespace {

node_registration standby(const std::string& id, int32_t nproc = 2, uint64_t incarnation = 1) {
  auto r = warm(id, nproc, incarnation);
  r.standby = true;
  return r;
}

// Room for 64 nodes, no cluster.standby_nodes; settling long enough that a
// plan made before it ends can only be a loss's.
membership_options room_for_more() {
  membership_options o;
  o.min_nodes = 2;
  o.settle = 10min;
  return o;
}

// a and b planned in generation 1 (trained), s registered by flag after
// them.
membership world_with_flagged_standby() {
  membership m(room_for_more());
  EXPECT_TRUE(m.admit(warm("a"), t0()).accepted);
  EXPECT_TRUE(m.admit(warm("b"), t0()).accepted);
  EXPECT_TRUE(m.admit(standby("s"), t0()).accepted);
  auto first = m.decide(t0() + 10min);
  EXPECT_TRUE(first.next) << first.reason;
  if (first.next) trained(m, *first.next);
  return m;
}

}  // namespace

TEST(standby_node_flag, waits_outside_a_world_with_room_and_is_not_counted_towards_min_nodes) {
  membership m(room_for_more());
  ASSERT_TRUE(m.admit(warm("a"), t0()).accepted);
  ASSERT_TRUE(m.admit(standby("s"), t0()).accepted);
  auto wait = m.decide(t0() + 20min);
  EXPECT_FALSE(wait.next) << wait.reason;
  EXPECT_EQ(wait.reason, "waiting for 2 nodes (cluster.min_nodes), have 1 [a]; standby (--standby-node, not counted): [s]");
  ASSERT_TRUE(m.admit(warm("b"), t0() + 20min).accepted);
  auto first = m.decide(t0() + 40min);
  ASSERT_TRUE(first.next) << first.reason;
  EXPECT_EQ(ids(*first.next), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(first.next->promoted.empty());
}

TEST(standby_node_flag, stays_outside_while_the_world_is_whole) {
  auto m = world_with_flagged_standby();
  EXPECT_EQ(ids(*m.state().current), (std::vector<std::string>{"a", "b"}));
  auto d = m.decide(t0() + 1h);
  EXPECT_FALSE(d.next) << d.reason;
  EXPECT_EQ(d.reason, "generation 1 is current: 2 nodes, world size 4; 1 standby waiting");
}

TEST(standby_node_flag, a_members_loss_promotes_it_in_the_same_plan_without_settling) {
  auto m = world_with_flagged_standby();
  ASSERT_TRUE(m.remove(node_id{"a"}, t0() + 11min));
  auto d = m.decide(t0() + 11min);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(ids(*d.next), (std::vector<std::string>{"b", "s"}));
  EXPECT_EQ(d.next->world_size, 4);
  EXPECT_EQ(strs(d.next->promoted), (std::vector<std::string>{"s"}));
  EXPECT_EQ(d.next->cause, plan_cause::node_lost);
  EXPECT_EQ(d.next->state_root, 0);  // b's first rank
}

TEST(standby_node_flag, a_node_that_left_is_replaced_too) {
  auto m = world_with_flagged_standby();
  ASSERT_TRUE(m.remove(node_id{"b"}, t0() + 11min, departure::left));
  auto d = m.decide(t0() + 11min);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(ids(*d.next), (std::vector<std::string>{"a", "s"}));
  EXPECT_EQ(strs(d.next->promoted), (std::vector<std::string>{"s"}));
}

TEST(standby_node_flag, a_lost_rank_of_a_member_promotes_nobody) {
  auto m = world_with_flagged_standby();
  const auto inc = m.find(node_id{"a"})->incarnation;
  ASSERT_TRUE(m.set_rank_ready(node_id{"a"}, inc, 1, false, t0() + 11min));
  auto d = m.decide(t0() + 11min);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(ids(*d.next), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(d.next->world_size, 3);
  EXPECT_TRUE(d.next->promoted.empty());
}

TEST(standby_node_flag, a_node_joining_with_the_loss_takes_the_place_before_it) {
  auto m = world_with_flagged_standby();
  ASSERT_TRUE(m.remove(node_id{"a"}, t0() + 11min));
  ASSERT_TRUE(m.admit(warm("c"), t0() + 11min).accepted);
  auto d = m.decide(t0() + 11min);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(ids(*d.next), (std::vector<std::string>{"b", "c"}));
  EXPECT_TRUE(d.next->promoted.empty());
}

TEST(standby_node_flag, once_promoted_it_trains_like_any_member) {
  auto m = world_with_flagged_standby();
  ASSERT_TRUE(m.remove(node_id{"a"}, t0() + 11min));
  auto promoted = m.decide(t0() + 11min);
  ASSERT_TRUE(promoted.next);
  trained(m, *promoted.next);
  // a comes back as a new process: a join, planned after settling; s keeps
  // its place.
  ASSERT_TRUE(m.admit(warm("a", 2, 2), t0() + 12min).accepted);
  auto grown = m.decide(t0() + 30min);
  ASSERT_TRUE(grown.next) << grown.reason;
  EXPECT_EQ(ids(*grown.next), (std::vector<std::string>{"a", "b", "s"}));
  EXPECT_TRUE(grown.next->promoted.empty());
}

TEST(standby_node_flag, counts_against_the_registration_limit) {
  membership_options o = room_for_more();
  o.max_nodes = 2;
  membership m(o);
  ASSERT_TRUE(m.admit(warm("a"), t0()).accepted);
  ASSERT_TRUE(m.admit(warm("b"), t0()).accepted);
  auto s = m.admit(standby("s"), t0());
  EXPECT_FALSE(s.accepted);
  EXPECT_EQ(m.find(node_id{"s"}), nullptr);
  EXPECT_EQ(s.reason,
            "cluster is full: 2 nodes are members and cluster.max_nodes is 2; standby node 's' (--standby-node) was not admitted (raise "
            "cluster.standby_nodes or stop a node)");
}

TEST(standby_node_flag, the_status_page_calls_both_kinds_standby_but_not_a_node_joining_into_room) {
  auto flagged = world_with_flagged_standby();
  EXPECT_EQ(waiting_standbys(flagged.state(), flagged.options()), (std::set<node_id>{node_id{"s"}}));
  auto by_config = world_with_standby();
  EXPECT_EQ(waiting_standbys(by_config.state(), by_config.options()), (std::set<node_id>{node_id{"c"}}));
  ASSERT_TRUE(flagged.admit(warm("c"), t0() + 11min).accepted);  // room: planned once settled
  EXPECT_EQ(waiting_standbys(flagged.state(), flagged.options()), (std::set<node_id>{node_id{"s"}}));
}
