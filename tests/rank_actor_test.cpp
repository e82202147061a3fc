// The rank actor under CAF's deterministic test coordinator, with a fake
// training thread: hello and heartbeats to the node, plans and stops handed
// to the worker, reports stamped with their generation.
#include "actors/rank_actor.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "actor_test_util.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

struct fake_work : rank_work {
  std::vector<uint64_t> offered;
  std::vector<bool> stops;  // checkpoint flag of each request_stop
  bool quit_called = false;
  rank_work_callbacks cb;
  bool offer(const pb::generation_plan& p) override {
    if (!offered.empty() && p.generation() <= offered.back()) return false;
    offered.push_back(p.generation());
    return true;
  }
  void request_stop(bool checkpoint) override { stops.push_back(checkpoint); }
  void quit() override { quit_called = true; }
  void take_slot(int32_t l) override { slots.push_back(l); }
  std::vector<int32_t> slots;  // take_slot's local ranks
};

class rank_actor_test : public ::testing::Test, public caf_fixture {
 protected:
  // local_rank -1: a warm spare.
  void start(int32_t local_rank = 1) {
    rank_actor_options o;
    o.header = envelope_header{1, "job", "rank/a/" + std::to_string(local_rank), 9};
    o.node_id = "a";
    o.local_rank = local_rank;
    o.pid = 4242;
    o.heartbeat_interval = 100ms;
    auto log = sent;
    o.send = [log](pb::envelope env) { log->push_back(std::move(env)); };
    auto w = work;
    o.make_work = [w](rank_work_callbacks cb) -> std::unique_ptr<rank_work> {
      w->cb = std::move(cb);
      // The actor owns its worker; the test keeps looking at this one.
      struct handle : rank_work {
        std::shared_ptr<fake_work> w;
        bool offer(const pb::generation_plan& p) override { return w->offer(p); }
        void request_stop(bool c) override { w->request_stop(c); }
        void quit() override { w->quit(); }
        void take_slot(int32_t l) override { w->take_slot(l); }
      };
      auto h = std::make_unique<handle>();
      h->w = w;
      return h;
    };
    actor = spawn(rank_actor, o);
    caf::anon_send(actor, start_atom::value);
    run();
  }
  void from_node(pb::envelope env) {
    caf::anon_send(actor, inbound{"node", "", std::move(env)});
    run();
  }
  std::vector<pb::envelope> with(pb::envelope::BodyCase body) const {
    std::vector<pb::envelope> out;
    for (const auto& e : *sent)
      if (e.body_case() == body) out.push_back(e);
    return out;
  }
  pb::envelope plan(uint64_t g) {
    pb::envelope env;
    env.set_job_id("job-7");
    env.mutable_generation_plan()->set_generation(g);
    return env;
  }

  std::shared_ptr<std::vector<pb::envelope>> sent = std::make_shared<std::vector<pb::envelope>>();
  std::shared_ptr<fake_work> work = std::make_shared<fake_work>();
  rank_actor_handle actor;
};

}  // namespace

TEST_F(rank_actor_test, says_hello_then_heartbeats_every_interval_with_the_newest_plan) {
  start();
  auto hello = with(pb::envelope::kRankHello);
  ASSERT_EQ(hello.size(), 1u);
  EXPECT_EQ(hello[0].rank_hello().local_rank(), 1);
  EXPECT_EQ(hello[0].rank_hello().pid(), 4242);
  EXPECT_EQ(hello[0].sender(), "rank/a/1");
  advance(1000ms);
  auto hb = with(pb::envelope::kHeartbeat);
  EXPECT_GE(hb.size(), 10u);
  EXPECT_LE(hb.size(), 11u);
  EXPECT_EQ(hb.back().generation(), 0u);
  from_node(plan(3));
  advance(100ms);
  EXPECT_EQ(with(pb::envelope::kHeartbeat).back().generation(), 3u);
  EXPECT_EQ(with(pb::envelope::kHeartbeat).back().job_id(), "job-7");
}

TEST_F(rank_actor_test, plans_go_to_the_worker_and_older_ones_do_not_move_the_generation) {
  start();
  from_node(plan(2));
  from_node(plan(1));
  EXPECT_EQ(work->offered, (std::vector<uint64_t>{2}));
  EXPECT_EQ(state_of<rank_actor_state>(actor).newest_plan, 2u);
}

TEST_F(rank_actor_test, reports_are_stamped_with_the_generation_they_belong_to) {
  start();
  from_node(plan(5));
  pb::step_report r;
  r.set_step(12);
  work->cb.on_step(4, r);  // still training in generation 4
  pb::rank_status s;
  s.set_status(pb::rank_status::STATE_READY);
  work->cb.on_status(5, s);
  run();
  auto steps = with(pb::envelope::kStepReport);
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].generation(), 4u);
  EXPECT_EQ(steps[0].step_report().step(), 12);
  EXPECT_EQ(steps[0].sender(), "rank/a/1");
  EXPECT_EQ(steps[0].incarnation(), 9u);
  auto st = with(pb::envelope::kRankStatus);
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].generation(), 5u);
}

TEST_F(rank_actor_test, a_shutdown_with_checkpoint_stops_at_a_step_boundary_and_a_plain_one_quits) {
  start();
  pb::envelope stop;
  stop.mutable_shutdown()->set_checkpoint(true);
  from_node(stop);
  EXPECT_EQ(work->stops, (std::vector<bool>{true}));
  EXPECT_FALSE(work->quit_called);
  pb::envelope bye;
  bye.mutable_shutdown()->set_reason("job finished");
  from_node(bye);
  EXPECT_TRUE(work->quit_called);
}

// A warm spare says hello without a local rank; the node's spare_slot makes
// it that rank (once): its worker is told, and what it sends names the rank.
TEST_F(rank_actor_test, a_spare_takes_the_slot_its_node_gives_it_once) {
  start(-1);
  auto hello = with(pb::envelope::kRankHello);
  ASSERT_EQ(hello.size(), 1u);
  EXPECT_EQ(hello[0].rank_hello().local_rank(), -1);
  pb::envelope slot;
  slot.mutable_spare_slot()->set_local_rank(2);
  from_node(slot);
  slot.mutable_spare_slot()->set_local_rank(3);
  from_node(slot);  // a second one changes nothing
  EXPECT_EQ(work->slots, std::vector<int32_t>{2});
  sent->clear();
  advance(100ms);
  auto hb = with(pb::envelope::kHeartbeat);
  ASSERT_FALSE(hb.empty());
  EXPECT_EQ(hb.back().sender(), "rank/a/2");
}
