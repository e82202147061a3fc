// A replacement node: a join that only brings the world back to the size it
// had before a loss or a leave is planned as soon as its ranks are ready (no
// cluster.settle_ms), while a join that grows the job beyond that size still
// settles; and the coordinator plans at those moments, not at its next tick.
// The membership's pure decision with the clock as a value, then the
// membership actor under CAF's deterministic test coordinator.
#include <gtest/gtest.h>

#include "actor_test_util.hpp"
#include "actors/job_actor.hpp"
#include "actors/membership.hpp"
#include "actors/membership_actor.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

clock_time t0() { return clock_time{} + 1h; }

node_registration cold(const std::string& id, int32_t nproc) {
  return node_registration{node_id{id}, id + ".local", nproc, 1, "peer-" + id, {}, 0, std::nullopt};
}

node_registration warm(const std::string& id, int32_t nproc) {
  auto r = cold(id, nproc);
  for (int32_t l = 0; l < nproc; ++l) r.ready_ranks.push_back(l);
  return r;
}

// Every rank of the plan reports that it holds the plan's state.
const plan& trained(membership& m, plan p) {
  const auto& cur = m.commit(std::move(p));
  for (const auto& r : cur.ranks) m.note_synced(r.node_id, m.find(r.node_id)->incarnation, r.local_rank, cur.generation);
  return cur;
}

// a and b (two ranks each) trained at world 4, then b was lost: world 2.
membership after_a_loss(clock_time& t) {
  membership_options o;
  o.settle = 300ms;
  membership m(o);
  m.admit(warm("a", 2), t);
  m.admit(warm("b", 2), t);
  t += 300ms;
  trained(m, *m.decide(t).next);
  t += 1s;
  m.remove(node_id{"b"}, t);
  trained(m, *m.decide(t).next);
  return m;
}

}  // namespace

TEST(replacement_join, a_node_refilling_a_lost_place_is_planned_without_settling) {
  auto t = t0();
  auto m = after_a_loss(t);
  ASSERT_EQ(m.state().current->world_size, 2);
  t += 1s;
  m.admit(cold("c", 2), t);
  m.set_rank_ready(node_id{"c"}, 1, 0, true, t);
  EXPECT_FALSE(m.decide(t).next);  // half ready: its second rank would need another plan
  m.set_rank_ready(node_id{"c"}, 1, 1, true, t + 10ms);
  auto d = m.decide(t + 10ms);
  ASSERT_TRUE(d.next) << d.reason;
  EXPECT_EQ(d.next->world_size, 4);
  EXPECT_EQ(d.next->cause, plan_cause::node_joined);
  EXPECT_TRUE(d.next->drain);
}

TEST(replacement_join, a_join_growing_the_job_beyond_its_peak_still_settles) {
  auto t = t0();
  auto m = after_a_loss(t);
  t += 1s;
  m.admit(warm("c", 2), t);
  m.admit(warm("d", 2), t);  // with c: world 6, above the peak of 4
  auto d = m.decide(t + 100ms);
  EXPECT_FALSE(d.next);
  ASSERT_TRUE(d.settles_at);
  EXPECT_EQ(*d.settles_at, t + 300ms);
  EXPECT_NE(d.reason.find("settling for 0.3 s"), std::string::npos) << d.reason;
  EXPECT_EQ(m.decide(t + 300ms).next->world_size, 6);
}

TEST(replacement_join, the_first_generation_has_no_peak_and_settles) {
  membership_options o;
  o.settle = 300ms;
  membership m(o);
  m.admit(warm("a", 1), t0());
  EXPECT_FALSE(m.decide(t0() + 100ms).next);
  trained(m, *m.decide(t0() + 300ms).next);
  m.admit(warm("b", 1), t0() + 1s);  // grows the job from 1 to 2: settles
  EXPECT_FALSE(m.decide(t0() + 1100ms).next);
  EXPECT_EQ(m.decide(t0() + 1300ms).next->world_size, 2);
}

namespace {

inbound status_from(const std::string& node_id, int32_t local_rank, pb::rank_status::state state, uint64_t generation = 0) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  in.env.mutable_rank_status()->set_local_rank(local_rank);
  in.env.mutable_rank_status()->set_status(state);
  return in;
}

inbound joined(const std::string& node_id) {
  auto in = register_from(node_id, 1);
  in.env.mutable_register_node()->add_ready_ranks(0);
  return in;
}

}  // namespace

class replacement_join_actor : public ::testing::Test, public caf_fixture {
 protected:
  void SetUp() override {
    coordinator_options o;
    o.membership.settle = 300ms;
    o.liveness = liveness_options{100ms, 1000ms};
    o.header = envelope_header{1, "job", "coordinator", 1};
    o.store_host = "coord.local";
    o.store_port = 29500;
    job_options jo;
    jo.max_steps = 100;
    jo.header = o.header;
    job = spawn(job_actor, jo, checkpoint_writer_handle{});
    members = spawn(membership_actor, o, wire.sink(), job);
    caf::anon_send(job, members_atom::value, members);
    run();
  }

  void send(const inbound& in) {
    caf::anon_send(members, in);
    run();
  }

  void keep_alive(std::initializer_list<std::string> ids, std::chrono::milliseconds total) {
    for (auto done = 0ms; done < total; done += 100ms) {
      for (const auto& id : ids) send(heartbeat_from(id, seq++));
      advance(std::min(100ms, total - done));
    }
  }

  // The plans sent to `peer` so far.
  size_t plans_to(const std::string& peer) { return wire.count(pb::envelope::kGenerationPlan, peer); }

  pb::generation_plan last_plan(const std::string& peer) { return wire.with(pb::envelope::kGenerationPlan, peer).back().env.generation_plan(); }

  // Every rank of the current plan reports READY in its generation.
  void trained() {
    const auto& st = state_of<membership_actor_state>(members).members.state();
    const plan cur = *st.current;
    for (const auto& r : cur.ranks) send(status_from(r.node_id.str(), r.local_rank, pb::rank_status::STATE_READY, cur.generation));
  }

  wire_log wire;
  job_handle job;
  membership_handle members;
  uint64_t seq = 1;
};

// Ticks are 100 ms apart from the start; the joins below happen 50 ms after
// one, so a plan made at a tick would come 50 ms late.
TEST_F(replacement_join_actor, a_replacement_is_planned_when_its_rank_is_ready_and_growth_when_the_settle_ends) {
  send(joined("a"));
  send(joined("b"));
  keep_alive({"a", "b"}, 400ms);
  ASSERT_EQ(last_plan("peer-a").world_size(), 2);
  trained();
  keep_alive({"a"}, 1200ms);  // b silent past the heartbeat timeout
  ASSERT_EQ(last_plan("peer-a").world_size(), 1);
  trained();
  send(register_from("c", 1));
  keep_alive({"a", "c"}, 150ms);
  ASSERT_EQ(plans_to("peer-c"), 0u);                       // no rank ready yet
  send(status_from("c", 0, pb::rank_status::STATE_IDLE));  // no time passes
  ASSERT_EQ(plans_to("peer-c"), 1u);
  EXPECT_EQ(last_plan("peer-c").world_size(), 2);
  trained();

  send(register_from("d", 1));  // beyond the peak of 2: settles 300 ms from its rank
  send(status_from("d", 0, pb::rank_status::STATE_IDLE));
  keep_alive({"a", "c", "d"}, 290ms);
  EXPECT_EQ(plans_to("peer-d"), 0u);
  advance(10ms);
  ASSERT_EQ(plans_to("peer-d"), 1u);
  EXPECT_EQ(last_plan("peer-d").world_size(), 3);
}
