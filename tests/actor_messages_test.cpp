// CAF 0.17 runs without type-ID checks: a message type that does not
// serialize is only noticed at run time, on a remote hop. Every message type
// the actors exchange is round-tripped here, alone and inside a caf::message.
#include <gtest/gtest.h>

#include "actor_test_util.hpp"
#include "actors/membership_handle.hpp"
#include "actors/messages.hpp"
#include "caf/binary_deserializer.hpp"
#include "caf/binary_serializer.hpp"
#include "caf/deep_to_string.hpp"
#include "caf/message.hpp"

using namespace dtactor;
using dtactor::test_support::caf_fixture;

namespace {

template <class T>
T round_trip(caf::actor_system& sys, T x) {
  std::vector<char> buf;
  caf::binary_serializer sink{sys, buf};
  auto err = sink(x);
  EXPECT_FALSE(err) << sys.render(err);
  T y;
  caf::binary_deserializer source{sys, buf};
  err = source(y);
  EXPECT_FALSE(err) << sys.render(err);
  return y;
}

caf::message message_round_trip(caf::actor_system& sys, const caf::message& msg) {
  auto x = msg;
  return round_trip(sys, x);
}

plan sample_plan() {
  plan p;
  p.generation = 7;
  p.world_size = 3;
  p.state_root = 1;
  p.nodes = {plan_node{node_id{"a"}, "a.local", "peer-a", 0, 1, 0, 11, {0}}, plan_node{node_id{"b"}, "b.local", "peer-b", 2, 3, 1, 12, {0, 2}}};
  p.ranks = {rank_slot{node_id{"a"}, 0, 0, 5}, rank_slot{node_id{"b"}, 0, 1, 6}, rank_slot{node_id{"b"}, 2, 2, 9}};
  p.drain = true;
  p.cause = plan_cause::node_left;
  p.adopted = true;
  p.leaving = {plan_node{node_id{"c"}, "c.local", "peer-c", 1, 1, 0, 13, {0}}};
  return p;
}

void expect_same(const std::vector<plan_node>& x, const std::vector<plan_node>& y) {
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i].node_id, y[i].node_id);
    EXPECT_EQ(x[i].advertise_addr, y[i].advertise_addr);
    EXPECT_EQ(x[i].peer, y[i].peer);
    EXPECT_EQ(x[i].node_rank, y[i].node_rank);
    EXPECT_EQ(x[i].nproc, y[i].nproc);
    EXPECT_EQ(x[i].first_global_rank, y[i].first_global_rank);
    EXPECT_EQ(x[i].incarnation, y[i].incarnation);
    EXPECT_EQ(x[i].local_ranks, y[i].local_ranks);
  }
}

void expect_same(const plan& x, const plan& y) {
  EXPECT_EQ(x.generation, y.generation);
  EXPECT_EQ(x.world_size, y.world_size);
  EXPECT_EQ(x.state_root, y.state_root);
  EXPECT_EQ(x.drain, y.drain);
  EXPECT_EQ(x.cause, y.cause);
  EXPECT_EQ(x.adopted, y.adopted);
  expect_same(x.nodes, y.nodes);
  expect_same(x.leaving, y.leaving);
  ASSERT_EQ(x.ranks.size(), y.ranks.size());
  for (size_t i = 0; i < x.ranks.size(); ++i) {
    EXPECT_EQ(x.ranks[i].node_id, y.ranks[i].node_id);
    EXPECT_EQ(x.ranks[i].local_rank, y.ranks[i].local_rank);
    EXPECT_EQ(x.ranks[i].global_rank, y.ranks[i].global_rank);
    EXPECT_EQ(x.ranks[i].ready_serial, y.ranks[i].ready_serial);
  }
}

inbound sample_inbound() {
  inbound in{links::nodes, std::string("peer\0with-nul", 13), test_support::node_envelope("a", 42, 3)};
  auto* p = in.env.mutable_generation_plan();
  p->set_generation(3);
  p->set_start_step(12);
  p->set_config_toml(std::string("\x00a\x10", 3));  // bytes survive
  p->add_ranks()->set_node_id("a");
  return in;
}

}  // namespace

class actor_messages : public ::testing::Test, public caf_fixture {};

TEST_F(actor_messages, inbound_round_trips_with_its_envelope_as_bytes) {
  auto x = sample_inbound();
  auto y = round_trip(sys(), x);
  EXPECT_EQ(y.link, x.link);
  EXPECT_EQ(y.peer, x.peer);
  EXPECT_EQ(y.env.SerializeAsString(), x.env.SerializeAsString());
  EXPECT_EQ(y.env.generation_plan().config_toml(), std::string("\x00a\x10", 3));
  EXPECT_EQ(y.env.incarnation(), 42u);
}

TEST_F(actor_messages, inbound_round_trips_inside_a_message) {
  auto m = message_round_trip(sys(), caf::make_message(sample_inbound()));
  ASSERT_TRUE(m.match_elements<inbound>());
  EXPECT_EQ(m.get_as<inbound>(0).env.generation_plan().start_step(), 12);
}

TEST_F(actor_messages, corrupt_envelope_bytes_fail_to_deserialize) {
  inbound x{"l", "p", {}};
  std::vector<char> buf;
  caf::binary_serializer sink{sys(), buf};
  std::string garbage = "\xff\xff\xff\xff";
  ASSERT_FALSE(sink(x.link, x.peer, garbage));
  inbound y;
  caf::binary_deserializer source{sys(), buf};
  EXPECT_TRUE(source(y));
}

TEST_F(actor_messages, plan_round_trips_alone_and_in_plan_atom_messages) {
  expect_same(round_trip(sys(), sample_plan()), sample_plan());
  auto m = message_round_trip(sys(), caf::make_message(plan_atom::value, sample_plan()));
  ASSERT_TRUE((m.match_elements<plan_atom, plan>()));
  expect_same(m.get_as<plan>(1), sample_plan());
}

TEST_F(actor_messages, a_round_trip_keeps_every_plan_field) {
  auto y = round_trip(sys(), sample_plan());
  EXPECT_TRUE(y.drain);
  EXPECT_EQ(y.cause, plan_cause::node_left);
  EXPECT_TRUE(y.adopted);
  ASSERT_EQ(y.leaving.size(), 1u);
  EXPECT_EQ(y.leaving[0].peer, "peer-c");
  EXPECT_EQ(y.nodes[1].local_ranks, (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(y.ranks[2].ready_serial, 9u);
}

TEST_F(actor_messages, atom_messages_round_trip) {
  {
    auto m = message_round_trip(sys(), caf::make_message(start_atom::value));
    EXPECT_TRUE(m.match_elements<start_atom>());
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(tick_atom::value));
    EXPECT_TRUE(m.match_elements<tick_atom>());
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(decide_atom::value));
    EXPECT_TRUE(m.match_elements<decide_atom>());
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(retry_atom::value, uint64_t{9}));
    ASSERT_TRUE((m.match_elements<retry_atom, uint64_t>()));
    EXPECT_EQ(m.get_as<uint64_t>(1), 9u);
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(lost_atom::value, std::string("b"), 1.25));
    ASSERT_TRUE((m.match_elements<lost_atom, std::string, double>()));
    EXPECT_EQ(m.get_as<std::string>(1), "b");
    EXPECT_DOUBLE_EQ(m.get_as<double>(2), 1.25);
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(rank_exit_atom::value, int32_t{4242}, int32_t{137}));
    ASSERT_TRUE((m.match_elements<rank_exit_atom, int32_t, int32_t>()));
    EXPECT_EQ(m.get_as<int32_t>(1), 4242);
    EXPECT_EQ(m.get_as<int32_t>(2), 137);
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(ckpt_atom::value, int64_t{40}, std::vector<int64_t>{30, 40}));
    ASSERT_TRUE((m.match_elements<ckpt_atom, int64_t, std::vector<int64_t>>()));
    EXPECT_EQ(m.get_as<int64_t>(1), 40);
    EXPECT_EQ(m.get_as<std::vector<int64_t>>(2), (std::vector<int64_t>{30, 40}));
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(closed_atom::value, std::string("node/b")));
    ASSERT_TRUE((m.match_elements<closed_atom, std::string>()));
    EXPECT_EQ(m.get_as<std::string>(1), "node/b");
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(fail_atom::value, std::string("no checkpoint left")));
    ASSERT_TRUE((m.match_elements<fail_atom, std::string>()));
    EXPECT_EQ(m.get_as<std::string>(1), "no checkpoint left");
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(shutdown_atom::value, std::string("job stopped"), true));
    ASSERT_TRUE((m.match_elements<shutdown_atom, std::string, bool>()));
    EXPECT_TRUE(m.get_as<bool>(2));
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(stop_atom::value, std::string("signal 2")));
    ASSERT_TRUE((m.match_elements<stop_atom, std::string>()));
    EXPECT_EQ(m.get_as<std::string>(1), "signal 2");
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(done_atom::value, int{130}));
    ASSERT_TRUE((m.match_elements<done_atom, int>()));
    EXPECT_EQ(m.get_as<int>(1), 130);
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(report_atom::value, uint64_t{6}, sample_inbound()));
    ASSERT_TRUE((m.match_elements<report_atom, uint64_t, inbound>()));
    EXPECT_EQ(m.get_as<uint64_t>(1), 6u);
    EXPECT_EQ(m.get_as<inbound>(2).env.generation_plan().generation(), sample_inbound().env.generation_plan().generation());
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(restart_atom::value, int32_t{1}, uint64_t{3}));
    ASSERT_TRUE((m.match_elements<restart_atom, int32_t, uint64_t>()));
    EXPECT_EQ(m.get_as<uint64_t>(2), 3u);
  }
  {
    auto m = message_round_trip(sys(), caf::make_message(leave_atom::value, std::string("SIGTERM")));
    ASSERT_TRUE((m.match_elements<leave_atom, std::string>()));
    EXPECT_EQ(m.get_as<std::string>(1), "SIGTERM");
  }
  {
    // The job actor's answer to plan_atom.
    auto m = message_round_trip(sys(), caf::make_message(int64_t{500}));
    ASSERT_TRUE(m.match_elements<int64_t>());
    EXPECT_EQ(m.get_as<int64_t>(0), 500);
  }
}

namespace {

// Stands for the membership actor: takes what its interface lists.
membership_handle::behavior_type any_membership() {
  return {
      [](inbound&) {},
      [](closed_atom, const std::string&) {},
      [](tick_atom) {},
      [](stop_atom) {},
      [](decide_atom) {},
      [](ckpt_atom, int64_t, const std::vector<int64_t>&) {},
      [](shutdown_atom, const std::string&, bool) { return true; },
  };
}

}  // namespace

TEST_F(actor_messages, a_membership_handle_round_trips_in_members_atom_messages) {
  auto members = spawn(any_membership);
  auto m = message_round_trip(sys(), caf::make_message(members_atom::value, members));
  ASSERT_TRUE((m.match_elements<members_atom, membership_handle>()));
  EXPECT_EQ(m.get_as<membership_handle>(1), members);
}

TEST_F(actor_messages, messages_render_for_logs) {
  auto text = caf::deep_to_string(sample_plan());
  EXPECT_NE(text.find("peer-b"), std::string::npos) << text;
  EXPECT_NE(caf::deep_to_string(sample_inbound()).find("nodes"), std::string::npos);
}

TEST_F(actor_messages, envelopes_carry_the_header) {
  envelope_header h{1, "job-1", "coordinator", 99};
  auto env = make_envelope(h, 4);
  EXPECT_EQ(env.protocol_version(), 1u);
  EXPECT_EQ(env.job_id(), "job-1");
  EXPECT_EQ(env.sender(), "coordinator");
  EXPECT_EQ(env.incarnation(), 99u);
  EXPECT_EQ(env.generation(), 4u);
}
