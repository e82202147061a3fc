// A node's warm spare rank processes (actors/spare_pool.hpp): the pool's
// bookkeeping as plain data, and the node agent handing a rank's slot to a
// spare, refilling the pool and stopping spares, under CAF's deterministic
// test coordinator with a fake launcher.
#include <gtest/gtest.h>

#include "actor_test_util.hpp"
#include "actors/node_agent.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

TEST(spare_pool, starts_missing_spares_at_the_delay_or_at_the_first_steps) {
  spare_pool p(spare_pool_options{2000ms, 100ms, 5000ms});
  const clock_time t0{};
  p.resize(1, t0);
  EXPECT_EQ(p.due(t0 + 1999ms), 0);
  EXPECT_EQ(p.due(t0 + 2000ms), 1);
  p.training(t0 + 500ms);  // steps reported: no need to wait
  EXPECT_EQ(p.due(t0 + 500ms), 1);
  p.started(41, t0 + 500ms);
  EXPECT_EQ(p.due(t0 + 10s), 0);
  EXPECT_FALSE(p.take(t0 + 600ms)) << "not warm yet";
  p.warmed(*p.by_pid(41));
  EXPECT_EQ(p.warm(), 1);
  auto taken = p.take(t0 + 700ms);
  ASSERT_TRUE(taken);
  EXPECT_EQ(taken->pid, 41);
  EXPECT_TRUE(p.processes().empty());
  EXPECT_EQ(p.due(t0 + 2699ms), 0);
  EXPECT_EQ(p.due(t0 + 2700ms), 1);
}

TEST(spare_pool, a_spare_that_ends_is_started_again_after_a_doubling_backoff) {
  spare_pool p(spare_pool_options{2000ms, 100ms, 300ms});
  const clock_time t0{};
  p.resize(1, t0);
  p.started(1, t0);
  EXPECT_FALSE(p.exited(99, t0));  // not a spare
  EXPECT_TRUE(p.exited(1, t0));
  EXPECT_EQ(p.due(t0 + 99ms), 0);
  EXPECT_EQ(p.due(t0 + 100ms), 1);
  p.started(2, t0 + 100ms);
  p.training(t0 + 100ms);  // steps do not cut a backoff short
  EXPECT_TRUE(p.exited(2, t0 + 100ms));
  EXPECT_EQ(p.due(t0 + 299ms), 0);
  EXPECT_EQ(p.due(t0 + 300ms), 1);
  p.started(3, t0 + 300ms);
  EXPECT_TRUE(p.exited(3, t0 + 300ms));
  EXPECT_EQ(p.due(t0 + 599ms), 0);  // capped at 300 ms
  EXPECT_EQ(p.due(t0 + 600ms), 1);
}

class spare_launcher : public process_launcher {
 public:
  result<int32_t> spawn(int32_t) override { return next_pid++; }
  result<int32_t> spawn_spare() override {
    spares.push_back(next_pid);
    return next_pid++;
  }
  void terminate(int32_t pid) override { terminated.push_back(pid); }
  void kill(int32_t pid) override { killed.push_back(pid); }
  std::vector<int32_t> spares, terminated, killed;
  int32_t next_pid = 1000;
};

class node_spares_test : public ::testing::Test, public caf_fixture {
 protected:
  // A node of one rank (pid 1000) with one spare, registered.
  void registered() {
    node_agent_options o;
    o.node_id = node_id{"a"};
    o.nproc = 1;
    o.header = envelope_header{1, "", "node/a", 7};
    o.liveness = liveness_options{100ms, 1000ms};
    o.spares = 1;
    o.spare_pool.start_delay = 500ms;
    o.events = [this](const node_event& e) {
      if (const auto* s = std::get_if<nev::spares>(&e)) spare_events.push_back(*s);
    };
    agent = spawn(node_agent, o, wire.sink(), launcher);
    caf::anon_send(agent, start_atom::value);
    run();
    inbound ack{links::coordinator, "", make_envelope(envelope_header{1, "job", "coordinator", 1}, 0)};
    ack.env.mutable_register_ack()->set_accepted(true);
    ack.env.mutable_register_ack()->set_job_id("job");
    ack.env.mutable_register_ack()->set_config_toml("[train]\n");
    send(ack);
    send(said(peer_of(1000), 0, 1000));
  }
  static std::string peer_of(int32_t pid) { return "p" + std::to_string(pid); }
  static inbound said(const std::string& peer, int32_t local_rank, int32_t pid) {
    inbound in{links::ranks, peer, make_envelope(envelope_header{1, "job", peer, 3}, 0)};
    in.env.mutable_rank_hello()->set_local_rank(local_rank);
    in.env.mutable_rank_hello()->set_pid(pid);
    return in;
  }
  static inbound status(const std::string& peer, pb::rank_status::state s) {
    inbound in{links::ranks, peer, make_envelope(envelope_header{1, "job", peer, 3}, 0)};
    in.env.mutable_rank_status()->set_status(s);
    in.env.mutable_rank_status()->set_local_rank(-1);
    return in;
  }
  void send(const inbound& in) {
    caf::anon_send(agent, in);
    run();
  }
  // The pool's spare started (after its delay), said hello and warmed up.
  int32_t warm_spare() {
    const auto before = launcher->spares.size();
    advance(600ms);
    EXPECT_EQ(launcher->spares.size(), before + 1);
    const int32_t pid = launcher->spares.back();
    send(said(peer_of(pid), -1, pid));
    send(status(peer_of(pid), pb::rank_status::STATE_IDLE));
    return pid;
  }
  node_agent_state& st() { return state_of<node_agent_state>(agent); }

  std::shared_ptr<spare_launcher> launcher = std::make_shared<spare_launcher>();
  wire_log wire;
  node_agent_handle agent;
  std::vector<nev::spares> spare_events;
};

TEST_F(node_spares_test, a_rank_that_exits_hands_its_slot_to_the_warm_spare_at_once) {
  registered();
  const int32_t spare = warm_spare();
  // Its warm-up went to it; its IDLE stayed on the node.
  EXPECT_EQ(wire.with(pb::envelope::kGenerationPlan, peer_of(spare)).size(), 1u);
  EXPECT_EQ(wire.with(pb::envelope::kRankStatus).size(), 0u);
  ASSERT_FALSE(spare_events.empty());
  EXPECT_EQ(spare_events.back().warm, 1);
  wire.clear();
  caf::anon_send(agent, rank_exit_atom::value, int32_t{1000}, int32_t{137});
  run();
  auto slot = wire.with(pb::envelope::kSpareSlot, peer_of(spare));
  ASSERT_EQ(slot.size(), 1u);
  EXPECT_EQ(slot[0].env.spare_slot().local_rank(), 0);
  auto exited = wire.with(pb::envelope::kRankStatus);
  ASSERT_EQ(exited.size(), 1u);
  EXPECT_EQ(exited[0].env.rank_status().status(), pb::rank_status::STATE_EXITED);
  EXPECT_TRUE(exited[0].env.rank_status().spare_takes_over());
  // The spare's message left first: it holds the slot before any plan.
  EXPECT_EQ(wire.all().front().env.body_case(), pb::envelope::kSpareSlot);
  EXPECT_EQ(st().ranks[0].pid, spare);
  EXPECT_TRUE(st().ranks[0].ready);
  EXPECT_EQ(spare_events.back().taken, 1);
  EXPECT_EQ(spare_events.back().warm, 0);
  // No cold start for the slot; the pool starts a new spare later.
  advance(3s);
  EXPECT_EQ(launcher->next_pid, 1003);  // rank 1000, spares 1001 and 1002
  EXPECT_EQ(launcher->spares.size(), 2u);
}

TEST_F(node_spares_test, without_a_warm_spare_the_rank_is_restarted_cold) {
  registered();
  advance(600ms);
  ASSERT_EQ(launcher->spares.size(), 1u);  // started, not warm yet
  wire.clear();
  caf::anon_send(agent, rank_exit_atom::value, int32_t{1000}, int32_t{137});
  run();
  EXPECT_TRUE(wire.with(pb::envelope::kSpareSlot).empty());
  auto exited = wire.with(pb::envelope::kRankStatus);
  ASSERT_EQ(exited.size(), 1u);
  EXPECT_FALSE(exited[0].env.rank_status().spare_takes_over());
  EXPECT_NE(st().ranks[0].pid, launcher->spares[0]);
}

TEST_F(node_spares_test, a_spare_warm_by_the_time_a_restart_is_due_takes_the_slot_instead) {
  registered();
  advance(600ms);
  ASSERT_EQ(launcher->spares.size(), 1u);
  const int32_t spare = launcher->spares[0];
  caf::anon_send(agent, rank_exit_atom::value, int32_t{1000}, int32_t{137});
  run();
  send(said(peer_of(spare), -1, spare));
  send(status(peer_of(spare), pb::rank_status::STATE_IDLE));
  wire.clear();
  advance(150ms);  // the restart's backoff: 100 ms
  EXPECT_EQ(wire.with(pb::envelope::kSpareSlot, peer_of(spare)).size(), 1u);
  EXPECT_EQ(st().ranks[0].pid, spare);
  EXPECT_EQ(launcher->next_pid, 1002);  // no cold start
}

TEST_F(node_spares_test, a_spare_that_dies_is_replaced_and_training_is_not_told) {
  registered();
  const int32_t spare = warm_spare();
  wire.clear();
  caf::anon_send(agent, rank_exit_atom::value, spare, int32_t{137});
  run();
  EXPECT_TRUE(wire.all().empty());  // nothing to the coordinator
  EXPECT_EQ(spare_events.back().warm, 0);
  advance(150ms);  // the backoff: 100 ms
  ASSERT_EQ(launcher->spares.size(), 2u);
  EXPECT_EQ(st().ranks[0].pid, 1000);
}

TEST_F(node_spares_test, a_stop_ends_the_spares_and_the_agent_waits_for_them) {
  registered();
  const int32_t spare = warm_spare();
  inbound stop{links::coordinator, "", make_envelope(envelope_header{1, "job", "coordinator", 1}, 0)};
  stop.env.mutable_shutdown()->set_reason("the job finished");
  send(stop);
  EXPECT_NE(std::find(launcher->terminated.begin(), launcher->terminated.end(), spare), launcher->terminated.end());
  caf::anon_send(agent, rank_exit_atom::value, int32_t{1000}, int32_t{0});
  run();
  EXPECT_EQ(st().phase, node_phase::stopped);  // the spare is still there
  caf::anon_send(agent, rank_exit_atom::value, spare, int32_t{0});
  run();
  advance(5s);
  EXPECT_EQ(launcher->spares.size(), 1u);  // none started again
}

}  // namespace

TEST_F(node_spares_test, the_spares_event_names_every_waiting_spare_process_for_its_memory_gauge) {
  registered();
  advance(600ms);
  ASSERT_EQ(launcher->spares.size(), 1u);
  const int32_t spare = launcher->spares[0];
  ASSERT_FALSE(spare_events.empty());
  EXPECT_EQ(spare_events.back().pids, (std::vector<int32_t>{spare}));  // warming up: its memory counts already
  EXPECT_EQ(spare_events.back().warm, 0);
  send(said(peer_of(spare), -1, spare));
  send(status(peer_of(spare), pb::rank_status::STATE_IDLE));
  EXPECT_EQ(spare_events.back().pids, (std::vector<int32_t>{spare}));
  caf::anon_send(agent, rank_exit_atom::value, int32_t{1000}, int32_t{137});
  run();
  EXPECT_EQ(spare_events.back().taken, 1);
  EXPECT_TRUE(spare_events.back().pids.empty());  // a rank now: tracked as one
}
