#include "net/wire.hpp"
#include "net/plan_layout.hpp"

#include <google/protobuf/util/message_differencer.h>
#include <gtest/gtest.h>

#include <set>

namespace dtactor {
namespace {

using google::protobuf::util::MessageDifferencer;

// (header, generation 7)
envelope_header test_identity() {
  return envelope_header{wire::protocol_version, "job-42", "node/alpha", 0x1234567890abcdefULL};
}

// An envelope carrying a body of the given oneof case, with every field of
// the body set to a non-default value. Fails the test for an unknown case, so
// a message type added to wire.proto without a round-trip test is caught.
pb::envelope sample(pb::envelope::BodyCase body) {
  auto env = make_envelope(test_identity(), 7);
  switch (body) {
    case pb::envelope::kRegisterNode: {
      auto* m = env.mutable_register_node();
      m->set_node_id("alpha");
      m->set_advertise_addr("10.0.0.5");
      m->set_nproc(2);
      m->set_hostname("alpha.local");
      m->set_metrics_port(9401);
      m->set_last_step(1234);
      m->set_last_generation(6);
      m->set_standby(true);
      break;
    }
    case pb::envelope::kRegisterAck: {
      auto* m = env.mutable_register_ack();
      m->set_accepted(true);
      m->set_reason("welcome");
      m->set_node_rank(3);
      m->set_job_id("job-42");
      m->set_config_toml("[train]\nmax_steps = 10\n");
      break;
    }
    case pb::envelope::kHeartbeat: {
      auto* m = env.mutable_heartbeat();
      m->set_seq(99);
      m->set_sent_steady_s(1700000000.25);
      m->set_step(77);
      break;
    }
    case pb::envelope::kHeartbeatAck: {
      auto* m = env.mutable_heartbeat_ack();
      m->set_seq(99);
      m->set_echoed_sent_steady_s(1700000000.25);
      break;
    }
    case pb::envelope::kGenerationPlan: {
      auto* m = env.mutable_generation_plan();
      m->set_generation(8);
      m->set_world_size(2);
      m->set_store_host("10.0.0.1");
      m->set_store_port(29500);
      for (int r = 0; r < 2; ++r) {
        auto* a = m->add_ranks();
        a->set_node_id(r == 0 ? "alpha" : "beta");
        a->set_local_rank(0);
        a->set_global_rank(r);
      }
      m->set_start_step(500);
      m->set_state_root(1);
      m->set_checkpoint_store("/mnt/shared/ckpt");
      m->set_checkpoint_step(400);
      m->set_config_toml("[model]\n");
      break;
    }
    case pb::envelope::kRankStatus: {
      auto* m = env.mutable_rank_status();
      m->set_global_rank(1);
      m->set_local_rank(1);
      m->set_status(pb::rank_status::STATE_FAILED);
      m->set_detail("Connection closed by peer");
      m->set_exit_code(134);
      m->set_step(501);
      break;
    }
    case pb::envelope::kStepReport: {
      auto* m = env.mutable_step_report();
      m->set_step(502);
      m->set_global_rank(0);
      m->set_world_size(2);
      m->set_loss(0.6931);
      m->set_step_s(0.12);
      m->set_allreduce_s(0.03);
      m->set_allreduce_exposed_s(0.01);
      m->set_samples(64);
      m->set_lr(3e-4);
      m->set_params_digest("abcdef0123456789");
      break;
    }
    case pb::envelope::kEvalReport: {
      auto* m = env.mutable_eval_report();
      m->set_step(600);
      (*m->mutable_metrics())["accuracy"] = 0.87;
      (*m->mutable_metrics())["loss"] = 0.41;
      m->add_examples("a cat -> un gatto");
      m->set_duration_s(2.5);
      break;
    }
    case pb::envelope::kCheckpointWritten: {
      auto* m = env.mutable_checkpoint_written();
      m->set_step(700);
      m->set_global_rank(1);
      m->set_world_size(2);
      m->set_meta(std::string("\0meta\xff", 6));
      auto* p = m->add_parts();
      p->set_name("ckpt-000000700.g3.r1-of-2.part");
      p->set_offset(4096);
      p->set_size(4000);
      p->set_xxh3(0x0123456789abcdefULL);
      p = m->add_parts();  // a second range of the same rank
      p->set_name("ckpt-000000700.g3.r1-of-2.1.part");
      p->set_offset(12288);
      p->set_size(100);
      p->set_xxh3(0xfedcba9876543210ULL);
      m->set_stall_s(0.01);
      m->set_write_s(0.5);
      break;
    }
    case pb::envelope::kLeave: {
      auto* m = env.mutable_leave();
      m->set_reason("SIGTERM");
      m->set_at_step(701);
      break;
    }
    case pb::envelope::kShutdown:
      env.mutable_shutdown()->set_reason("max_steps reached");
      break;
    case pb::envelope::kRankHello: {
      auto* m = env.mutable_rank_hello();
      m->set_local_rank(1);
      m->set_pid(4242);
      break;
    }
    case pb::envelope::kJobError:
      env.mutable_job_error()->set_message("dataset not found");
      break;
    case pb::envelope::kSpareSlot:
      env.mutable_spare_slot()->set_local_rank(3);
      break;
    default:
      ADD_FAILURE() << "no sample for body field " << static_cast<int>(body)
                    << ": add one to wire_test.cpp";
  }
  return env;
}

TEST(wire, every_body_type_round_trips) {
  const auto* oneof = pb::envelope::descriptor()->FindOneofByName("body");
  ASSERT_NE(oneof, nullptr);
  ASSERT_GE(oneof->field_count(), 13);
  std::set<std::string> seen;
  for (int i = 0; i < oneof->field_count(); ++i) {
    const auto* field = oneof->field(i);
    auto env = sample(static_cast<pb::envelope::BodyCase>(field->number()));
    ASSERT_EQ(static_cast<int>(env.body_case()), field->number()) << field->name();
    EXPECT_EQ(wire::body_name(env), field->name());
    auto bytes = wire::encode(env);
    ASSERT_TRUE(bytes) << bytes.message();
    auto back = wire::decode(bytes.value(), "job-42");
    ASSERT_TRUE(back) << field->name() << ": " << back.message();
    EXPECT_TRUE(MessageDifferencer::Equals(env, back.value())) << field->name();
    EXPECT_EQ(back->protocol_version(), wire::protocol_version);
    EXPECT_EQ(back->sender(), "node/alpha");
    EXPECT_EQ(back->incarnation(), 0x1234567890abcdefULL);
    EXPECT_EQ(back->generation(), 7u);
    EXPECT_EQ(back->job_id(), "job-42");
    seen.insert(field->name());
  }
  EXPECT_EQ(seen.size(), static_cast<std::size_t>(oneof->field_count()));
}

TEST(wire, make_envelope_fills_the_header) {
  auto env = make_envelope(test_identity(), 7);
  EXPECT_EQ(env.protocol_version(), wire::protocol_version);
  EXPECT_EQ(env.sender(), "node/alpha");
  EXPECT_EQ(env.job_id(), "job-42");
  EXPECT_EQ(env.generation(), 7u);
  EXPECT_EQ(env.body_case(), pb::envelope::BODY_NOT_SET);
  EXPECT_STREQ(wire::body_name(env), "none");
}

// Senders are built and parsed in one place: what a process writes reads
// back as the same value, and anything else is `unknown` with no node id.
TEST(wire, sender_ids_round_trip_and_garbage_is_unknown) {
  for (const auto& id : {sender_id::coordinator(), sender_id::of_node("gpu-7"), sender_id::of_node("host-net4026532"),
                         sender_id::of_rank("gpu-7", 0), sender_id::of_rank("a/b", 12)}) {
    EXPECT_EQ(sender_id::parse(id.to_string()), id) << id.to_string();
  }
  EXPECT_EQ(sender_id::parse("node/x").who, sender_id::role::node);
  EXPECT_EQ(sender_id::parse("rank/x/3").local_rank, 3);
  EXPECT_EQ(sender_id::parse("rank/x/3").node, "x");
  for (const char* bad : {"", "node/", "rank/", "rank/x", "rank/x/", "rank//1", "rank/x/-1", "rank/x/1a", "rank/x/99999999999",
                          "coordinatorX", "hello", "Node/x"}) {
    const auto id = sender_id::parse(bad);
    EXPECT_EQ(id.who, sender_id::role::unknown) << bad;
    EXPECT_TRUE(id.node.empty()) << bad;
  }
}

TEST(wire, encode_refuses_an_envelope_without_body) {
  auto bytes = wire::encode(make_envelope(test_identity(), 7));
  ASSERT_FALSE(bytes);
  EXPECT_NE(bytes.message().find("without a body"), std::string::npos);
}

TEST(wire, empty_frame) {
  auto d = wire::decode(std::string_view{}, "job-42");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.kind(), wire::drop_kind::empty);
}

TEST(wire, garbage_that_does_not_parse) {
  // 0xff... is an invalid tag / truncated varint: never parses.
  const std::string junk = "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff";
  auto d = wire::decode(junk, "job-42");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.kind(), wire::drop_kind::garbage);
  EXPECT_STREQ(wire::to_string(d.kind()), "garbage");
}

TEST(wire, garbage_that_parses_but_is_no_envelope) {
  // Field 3 (sender) as a string: valid protobuf, but no version and no body.
  pb::envelope env;
  env.set_sender("hello");
  auto d = wire::decode(env.SerializeAsString(), "job-42");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.kind(), wire::drop_kind::garbage);
}

TEST(wire, envelope_without_body_is_garbage) {
  auto env = make_envelope(test_identity(), 7);
  auto d = wire::decode(env.SerializeAsString(), "job-42");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.kind(), wire::drop_kind::garbage);
}

TEST(wire, version_mismatch) {
  auto env = sample(pb::envelope::kHeartbeat);
  env.set_protocol_version(wire::protocol_version + 1);
  auto d = wire::decode(env.SerializeAsString(), "job-42");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.kind(), wire::drop_kind::version_mismatch);
  EXPECT_NE(d.message().find("protocol version 2"), std::string::npos) << d.message();
  // A frame with a body but no version is a peer speaking another protocol.
  env.set_protocol_version(0);
  auto zero = wire::decode(env.SerializeAsString(), "job-42");
  ASSERT_FALSE(zero);
  EXPECT_EQ(zero.kind(), wire::drop_kind::version_mismatch);
}

TEST(wire, foreign_job) {
  auto env = sample(pb::envelope::kHeartbeat);
  env.set_job_id("job-other");
  auto d = wire::decode(env.SerializeAsString(), "job-42");
  ASSERT_FALSE(d);
  EXPECT_EQ(d.kind(), wire::drop_kind::foreign_job);
  EXPECT_NE(d.message().find("job-other"), std::string::npos);
}

TEST(wire, unknown_job_on_either_side_is_accepted) {
  auto env = sample(pb::envelope::kRegisterNode);
  env.set_job_id("");  // a node that does not know the job yet
  EXPECT_TRUE(wire::decode(env.SerializeAsString(), "job-42"));
  env.set_job_id("job-42");
  EXPECT_TRUE(wire::decode(env.SerializeAsString(), ""));  // we do not know ours yet
}

TEST(wire, incarnations_differ_and_are_nonzero) {
  std::set<uint64_t> seen;
  for (int i = 0; i < 100; ++i) {
    auto v = wire::new_incarnation();
    EXPECT_NE(v, 0u);
    seen.insert(v);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(wire, drop_kind_names_are_distinct) {
  std::set<std::string> names;
  for (std::size_t i = 0; i < wire::drop_kind_count; ++i)
    names.insert(wire::to_string(static_cast<wire::drop_kind>(i)));
  EXPECT_EQ(names.size(), wire::drop_kind_count);
  EXPECT_EQ(names.count("unknown"), 0u);
}

}  // namespace

// A plan's layout is runs of nodes holding as many ranks: one run for a
// job whose nodes are alike however many there are, and what a node reads
// back is every node's count in order.
TEST(plan_layout, nodes_alike_make_one_run_and_expand_back_in_order) {
  pb::generation_plan p;
  for (int i = 0; i < 10000; ++i) add_node_ranks(p, 8);
  EXPECT_EQ(std::vector<int32_t>(p.node_rank_runs().begin(), p.node_rank_runs().end()), (std::vector<int32_t>{10000, 8}));
  EXPECT_EQ(node_rank_counts(p, 80000), std::vector<int32_t>(10000, 8));
  EXPECT_EQ(node_rank_counts(p, 80).size(), 10u);
  EXPECT_LT(p.ByteSizeLong(), 16u);

  pb::generation_plan q;
  for (int32_t r : {2, 2, 1, 3, 3, 3, 2}) add_node_ranks(q, r);
  EXPECT_EQ(std::vector<int32_t>(q.node_rank_runs().begin(), q.node_rank_runs().end()), (std::vector<int32_t>{2, 2, 1, 1, 3, 3, 1, 2}));
  EXPECT_EQ(node_rank_counts(q, 100), (std::vector<int32_t>{2, 2, 1, 3, 3, 3, 2}));
}

pb::generation_plan q_of(std::initializer_list<int32_t> ranks) {
  pb::generation_plan p;
  for (int32_t r : ranks) add_node_ranks(p, r);
  return p;
}

// A layout from outside is read within bounds: a run claiming more nodes
// than the world has is cut at the world, and a malformed one (odd length,
// a negative count) reads as none.
TEST(plan_layout, a_malformed_or_oversized_layout_is_bounded) {
  pb::generation_plan big;
  big.add_node_rank_runs(2000000000);
  big.add_node_rank_runs(1);
  EXPECT_EQ(node_rank_counts(big, 3).size(), 3u);
  // Nodes holding no rank do not cut off the ranks after them.
  pb::generation_plan gaps;
  for (int32_t r : {1, 0, 0, 1}) add_node_ranks(gaps, r);
  EXPECT_EQ(node_rank_counts(gaps, 2), (std::vector<int32_t>{1, 0, 0, 1}));
  EXPECT_EQ(node_rank_counts(q_of({2, 2, 1}), 3), (std::vector<int32_t>{2, 2}));
  pb::generation_plan odd;
  odd.add_node_rank_runs(2);
  EXPECT_TRUE(node_rank_counts(odd, 10).empty());
  pb::generation_plan negative;
  negative.add_node_rank_runs(-1);
  negative.add_node_rank_runs(4);
  EXPECT_TRUE(node_rank_counts(negative, 10).empty());
}

}  // namespace dtactor
