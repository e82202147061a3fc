// Checkpoints the coordinator commits, refuses and plans from
// (tests/coordinator_actors_fixture.hpp).
#include <gtest/gtest.h>

#include "coordinator_actors_fixture.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace dtactor::coordinator_test;
using namespace std::chrono_literals;

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
