// The node agent under CAF's deterministic test coordinator, with a fake
// process launcher; and a whole in-memory cluster (membership + job actors and
// two node agents) with a partition switch.
#include "actors/node_agent.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>

#include "actor_test_util.hpp"
#include "actors/membership_actor.hpp"

using namespace dtactor;
using namespace dtactor::test_support;
using namespace std::chrono_literals;

namespace {

class fake_launcher : public process_launcher {
 public:
  result<int32_t> spawn(int32_t local_rank) override {
    if (fail_next) {
      fail_next = false;
      return dtactor::make_error("rank binary not found");
    }
    spawned.push_back({local_rank, next_pid});
    return next_pid++;
  }
  void terminate(int32_t pid) override { terminated.push_back(pid); }
  void kill(int32_t pid) override { killed.push_back(pid); }

  size_t spawns_of(int32_t local_rank) const {
    size_t n = 0;
    for (const auto& s : spawned) n += s.first == local_rank;
    return n;
  }
  int32_t last_pid_of(int32_t local_rank) const {
    int32_t pid = -1;
    for (const auto& s : spawned)
      if (s.first == local_rank) pid = s.second;
    return pid;
  }

  std::vector<std::pair<int32_t, int32_t>> spawned;  // (local rank, pid)
  std::vector<int32_t> terminated;
  std::vector<int32_t> killed;
  int32_t next_pid = 1000;
  bool fail_next = false;
};

node_agent_options agent_opts(const std::string& id, int32_t nproc) {
  node_agent_options o;
  o.node_id = node_id{id};
  o.advertise_addr = id + ".local";
  o.hostname = id;
  o.nproc = nproc;
  o.header = envelope_header{1, "", "node/" + id, 7};
  o.liveness = liveness_options{100ms, 1000ms};
  o.register_backoff_initial = 100ms;
  o.register_backoff_max = 400ms;
  o.restart_backoff_initial = 100ms;
  o.restart_backoff_max = 1000ms;
  return o;
}

pb::envelope from_coordinator(uint64_t generation = 0) { return make_envelope(envelope_header{1, "job", "coordinator", 1}, generation); }

inbound ack(bool accepted, int32_t node_rank, const std::string& reason = "") {
  inbound in{links::coordinator, "", from_coordinator()};
  auto* a = in.env.mutable_register_ack();
  a->set_accepted(accepted);
  a->set_node_rank(node_rank);
  a->set_reason(reason);
  a->set_job_id("job");
  return in;
}

inbound plan_for(const std::string& node_id, uint64_t generation, int32_t nproc) {
  inbound in{links::coordinator, "", from_coordinator(generation)};
  auto* p = in.env.mutable_generation_plan();
  p->set_generation(generation);
  p->set_world_size(nproc);
  for (int32_t l = 0; l < nproc; ++l) {
    auto* r = p->add_ranks();
    r->set_node_id(node_id);
    r->set_local_rank(l);
    r->set_global_rank(l);
  }
  return in;
}

inbound from_rank(const std::string& peer) { return inbound{links::ranks, peer, make_envelope(envelope_header{1, "job", peer, 3}, 0)}; }

inbound hello(int32_t local_rank, int32_t pid) {
  auto in = from_rank("r" + std::to_string(local_rank));
  in.env.mutable_rank_hello()->set_local_rank(local_rank);
  in.env.mutable_rank_hello()->set_pid(pid);
  return in;
}

}  // namespace

TEST(backoff, doubles_from_initial_and_caps) {
  EXPECT_EQ(backoff_delay(100ms, 1000ms, 0), 100ms);
  EXPECT_EQ(backoff_delay(100ms, 1000ms, 1), 200ms);
  EXPECT_EQ(backoff_delay(100ms, 1000ms, 3), 800ms);
  EXPECT_EQ(backoff_delay(100ms, 1000ms, 4), 1000ms);
  EXPECT_EQ(backoff_delay(100ms, 1000ms, 4000000000u), 1000ms);
}

class node_agent_test : public ::testing::Test, public caf_fixture {
 protected:
  void start(int32_t nproc = 2) {
    auto o = agent_opts("a", nproc);
    // The test coordinator runs the agent on this thread.
    o.events = [this](const node_event& e) { events.push_back(e); };
    o.annotate_report = [](const std::string& peer, pb::step_report& r) { r.set_node_id("annotated for " + peer); };
    agent = spawn(node_agent, o, wire.sink(), launcher);
    caf::anon_send(agent, start_atom::value);
    run();
  }
  void send(const inbound& in) {
    caf::anon_send(agent, in);
    run();
  }
  void registered(int32_t nproc = 2) {
    start(nproc);
    send(ack(true, 0));
    wire.clear();
  }
  // Registered, both ranks said hello, training in generation 1.
  void running() {
    registered();
    send(hello(0, launcher->last_pid_of(0)));
    send(hello(1, launcher->last_pid_of(1)));
    send(plan_for("a", 1, 2));
    ASSERT_EQ(st().phase, node_phase::running);
  }
  // The coordinator stopping the job: ranks stop after a final checkpoint.
  static inbound job_stop(const std::string& reason) {
    inbound in{links::coordinator, "", from_coordinator(1)};
    in.env.mutable_shutdown()->set_reason(reason);
    in.env.mutable_shutdown()->set_checkpoint(true);
    return in;
  }
  // The rank's current process exits with `code`; then the longest restart
  // backoff passes (1 s here) while the coordinator keeps talking.
  void rank_dies(int32_t local_rank, int32_t code) {
    caf::anon_send(agent, rank_exit_atom::value, launcher->last_pid_of(local_rank), code);
    run();
    for (int i = 0; i < 2; ++i) {
      send(inbound{links::coordinator, "", from_coordinator()});
      advance(500ms);
    }
  }
  node_agent_state& st() { return state_of<node_agent_state>(agent); }
  size_t registers() const { return wire.count(pb::envelope::kRegisterNode); }
  // The longest time without a register while the coordinator stays silent
  // for `span` (from the last register sent, to the end of `span`).
  int64_t longest_register_gap_ms(std::chrono::milliseconds span) {
    auto last = now();
    auto count = registers();
    clock_duration longest{0};
    for (auto t = 0ms; t < span; t += 1ms) {
      advance(1ms, 1ms);
      if (registers() == count) continue;
      longest = std::max(longest, now() - last);
      last = now();
      count = registers();
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::max(longest, now() - last)).count();
  }

  template <class E>
  std::vector<E> events_of() const {
    std::vector<E> out;
    for (const auto& e : events)
      if (const auto* x = std::get_if<E>(&e)) out.push_back(*x);
    return out;
  }

  std::shared_ptr<fake_launcher> launcher = std::make_shared<fake_launcher>();
  wire_log wire;
  node_agent_handle agent;
  std::vector<node_event> events;
};

TEST_F(node_agent_test, retries_registration_with_backoff_until_acked) {
  start();
  EXPECT_EQ(st().phase, node_phase::registering);
  ASSERT_EQ(registers(), 1u);
  auto r = wire.with(pb::envelope::kRegisterNode)[0];
  EXPECT_EQ(r.link, links::coordinator);
  EXPECT_EQ(r.env.sender(), "node/a");
  EXPECT_EQ(r.env.incarnation(), 7u);
  EXPECT_EQ(r.env.register_node().node_id(), "a");
  EXPECT_EQ(r.env.register_node().nproc(), 2);
  EXPECT_TRUE(launcher->spawned.empty());  // ranks start once the node is a member

  advance(90ms);
  EXPECT_EQ(registers(), 1u);
  advance(10ms);  // t = 100 ms
  EXPECT_EQ(registers(), 2u);
  advance(200ms);  // t = 300 ms
  EXPECT_EQ(registers(), 3u);
  advance(330ms);  // t = 630 ms
  EXPECT_EQ(registers(), 3u);
  advance(10ms);  // t = 640 ms: 400 ms, capped at a third of the 1 s heartbeat timeout (333 ms)
  EXPECT_EQ(registers(), 4u);
  advance(460ms);  // t = 1100 ms: another 333 ms later
  EXPECT_EQ(registers(), 5u);
  EXPECT_EQ(wire.count(pb::envelope::kHeartbeat), 0u);

  send(ack(true, 3));
  EXPECT_EQ(st().phase, node_phase::registered);
  EXPECT_EQ(st().node_rank, 3);
  EXPECT_EQ(st().job_id, "job");
  ASSERT_EQ(launcher->spawned.size(), 2u);
  EXPECT_EQ(launcher->spawns_of(0), 1u);
  EXPECT_EQ(launcher->spawns_of(1), 1u);
  send(ack(true, 3));  // duplicate ack of a retried register: no second set of ranks
  EXPECT_EQ(launcher->spawned.size(), 2u);

  advance(500ms);
  EXPECT_EQ(registers(), 5u);  // retries stopped
  EXPECT_GE(wire.count(pb::envelope::kHeartbeat), 4u);
  EXPECT_LE(wire.count(pb::envelope::kHeartbeat), 6u);
}

// A node that registers (again) sends nothing but registers, and the
// coordinator counts a peer silent for heartbeat_timeout as lost: however
// long the coordinator stays silent, registers stay well inside the timeout
// (at least two in any timeout), the job's own timeout once it is known.
TEST_F(node_agent_test, register_retries_stay_well_inside_the_heartbeat_timeout) {
  auto o = agent_opts("a", 1);
  o.register_backoff_max = 1000ms;  // the node process's setting, as long as its timeout
  o.liveness_from_config = [](const std::string& toml) -> std::optional<liveness_options> {
    if (toml == "fast") return liveness_options{50ms, 600ms};
    return std::nullopt;
  };
  agent = spawn(node_agent, o, wire.sink(), launcher);
  caf::anon_send(agent, start_atom::value);
  run();
  ASSERT_EQ(registers(), 1u);
  EXPECT_LT(longest_register_gap_ms(4000ms), 1000 / 2);
  ASSERT_GE(registers(), 9u);

  auto fast = ack(true, 0);
  fast.env.mutable_register_ack()->set_config_toml("fast");
  send(fast);
  ASSERT_EQ(st().phase, node_phase::registered);
  wire.clear();
  while (st().phase != node_phase::registering) advance(1ms, 1ms);  // the coordinator falls silent
  EXPECT_EQ(registers(), 1u);
  EXPECT_LT(longest_register_gap_ms(4000ms), 600 / 2);
}

TEST_F(node_agent_test, a_refusal_keeps_it_retrying_and_records_the_reason) {
  start();
  send(ack(false, -1, "cluster is full"));
  EXPECT_EQ(st().phase, node_phase::registering);
  EXPECT_EQ(st().last_refusal, "cluster is full");
  advance(100ms);
  EXPECT_EQ(registers(), 2u);
  EXPECT_TRUE(launcher->spawned.empty());
}

TEST_F(node_agent_test, heartbeats_every_interval_and_registers_again_when_the_coordinator_goes_silent) {
  registered();
  for (int i = 0; i < 5; ++i) {
    advance(100ms);
    inbound a{links::coordinator, "", from_coordinator()};
    a.env.mutable_heartbeat_ack()->set_seq(i);
    send(a);
  }
  auto hbs = wire.with(pb::envelope::kHeartbeat);
  ASSERT_EQ(hbs.size(), 5u);
  EXPECT_EQ(hbs[4].env.heartbeat().seq(), 5u);
  EXPECT_EQ(registers(), 0u);
  advance(1000ms);  // coordinator silent past the timeout
  EXPECT_EQ(st().phase, node_phase::registering);
  EXPECT_EQ(registers(), 1u);
  EXPECT_TRUE(launcher->terminated.empty());  // training goes on meanwhile
  // Told "not a member" while registered: register again at once.
  send(ack(true, 0));
  send(ack(false, -1, "node 'a' is not a member; register again"));
  EXPECT_EQ(st().phase, node_phase::registering);
  EXPECT_EQ(registers(), 2u);
}

// Every beat goes, but only one in three asks for an answer (at least every
// quarter of the timeout); a coordinator that asks for a longer interval
// gets beats that far apart, and the node still hears from it in time.
TEST_F(node_agent_test, heartbeats_ask_for_an_ack_every_quarter_timeout_and_follow_the_asked_interval) {
  registered();
  std::vector<bool> asked;
  for (int i = 0; i < 6; ++i) {
    advance(100ms);
    asked.push_back(!wire.with(pb::envelope::kHeartbeat).back().env.heartbeat().no_ack());
  }
  ASSERT_EQ(wire.with(pb::envelope::kHeartbeat).size(), 6u);
  EXPECT_EQ(asked, (std::vector<bool>{true, false, false, true, false, false}));
  inbound a{links::coordinator, "", from_coordinator()};
  a.env.mutable_heartbeat_ack()->set_interval_ms(300);
  send(a);
  for (int i = 0; i < 9; ++i) advance(100ms);
  EXPECT_EQ(wire.with(pb::envelope::kHeartbeat).size(), 9u);  // 6, then one every 300 ms
  for (const auto& hb : wire.with(pb::envelope::kHeartbeat)) EXPECT_GT(hb.env.heartbeat().seq(), 0u);
  EXPECT_FALSE(wire.with(pb::envelope::kHeartbeat).back().env.heartbeat().no_ack());  // 300 ms since the last ask
  EXPECT_EQ(registers(), 0u);
}

// A connection to a coordinator address came up (a standby took the lease
// and listens, or the coordinator restarted): the node registers there at
// once, not after the heartbeat timeout or its next retry, and training
// goes on in the generation it holds.
TEST_F(node_agent_test, registers_at_once_when_a_connection_to_a_coordinator_comes_up) {
  running();
  wire.clear();
  caf::anon_send(agent, reachable_atom::value, std::string("tcp://standby:29400"));
  run();
  EXPECT_EQ(st().phase, node_phase::registering);
  ASSERT_EQ(registers(), 1u);
  const auto& r = wire.with(pb::envelope::kRegisterNode)[0].env.register_node();
  EXPECT_EQ(r.current_plan().generation(), 1u);  // what the new leader adopts
  EXPECT_TRUE(launcher->terminated.empty());
  send(ack(true, 1));
  EXPECT_EQ(st().phase, node_phase::registered);
  EXPECT_EQ(st().plan->generation(), 1u);

  // While registering (the heartbeat timeout came first), a register goes
  // out at once too, before the retry is due.
  advance(1000ms);
  ASSERT_EQ(st().phase, node_phase::registering);
  const auto before = registers();
  caf::anon_send(agent, reachable_atom::value, std::string("tcp://standby:29400"));
  run();
  EXPECT_EQ(registers(), before + 1);
  EXPECT_EQ(st().phase, node_phase::registering);
}

TEST_F(node_agent_test, restarts_a_rank_that_exited_with_backoff_and_reports_it) {
  registered();
  auto first = launcher->last_pid_of(0);
  caf::anon_send(agent, rank_exit_atom::value, first, int32_t{137});
  run();
  auto status = wire.with(pb::envelope::kRankStatus);
  ASSERT_EQ(status.size(), 1u);
  EXPECT_EQ(status[0].link, links::coordinator);
  EXPECT_EQ(status[0].env.rank_status().status(), pb::rank_status::STATE_EXITED);
  EXPECT_EQ(status[0].env.rank_status().local_rank(), 0);
  EXPECT_EQ(status[0].env.rank_status().exit_code(), 137);
  EXPECT_EQ(launcher->spawns_of(0), 1u);  // not at once
  advance(100ms);
  ASSERT_EQ(launcher->spawns_of(0), 2u);
  auto second = launcher->last_pid_of(0);
  EXPECT_NE(second, first);

  // A stale exit of the old process changes nothing.
  caf::anon_send(agent, rank_exit_atom::value, first, int32_t{9});
  run();
  EXPECT_EQ(wire.count(pb::envelope::kRankStatus), 1u);

  // Exiting again without having become ready: the backoff doubles.
  caf::anon_send(agent, rank_exit_atom::value, second, int32_t{1});
  run();
  advance(150ms);
  EXPECT_EQ(launcher->spawns_of(0), 2u);
  advance(60ms);
  EXPECT_EQ(launcher->spawns_of(0), 3u);
  EXPECT_EQ(launcher->spawns_of(1), 1u);  // the other rank was left alone

  // Ready resets the backoff.
  send(hello(0, launcher->last_pid_of(0)));
  auto ready = from_rank("r0");
  ready.env.mutable_rank_status()->set_status(pb::rank_status::STATE_READY);
  ready.env.mutable_rank_status()->set_local_rank(0);
  send(ready);
  EXPECT_EQ(st().ranks[0].failures, 0u);
}

// A rank that dies again and again before completing a step (the kernel's
// OOM killer at the same step each generation) is given up after
// rank_exit_limit exits in a row on its node (5 by default); a step beyond
// any reported before starts the count again, and the node's other ranks go on.
TEST_F(node_agent_test, a_rank_that_keeps_exiting_without_a_step_is_given_up_and_the_others_go_on) {
  registered();
  ASSERT_EQ(st().opts.rank_exit_limit, 5);
  auto die = [&] { rank_dies(0, 137); };
  for (int i = 0; i < 4; ++i) die();
  ASSERT_EQ(launcher->spawns_of(0), 5u);
  // The fifth process completes a step: the count starts again.
  send(hello(0, launcher->last_pid_of(0)));
  auto step = from_rank("r0");
  step.env.mutable_step_report()->set_step(3);
  send(step);
  EXPECT_EQ(st().exits_without_step, 0u);
  for (int i = 0; i < 4; ++i) die();
  EXPECT_EQ(launcher->spawns_of(0), 9u);
  // The ninth reports step 3 again (resumed from an older checkpoint, or
  // the same step once more): no progress, the count goes on.
  send(hello(0, launcher->last_pid_of(0)));
  send(step);
  EXPECT_EQ(st().exits_without_step, 4u);
  EXPECT_FALSE(st().ranks[0].given_up);
  die();  // the fifth exit in a row without a step
  EXPECT_TRUE(st().ranks[0].given_up);
  EXPECT_EQ(launcher->spawns_of(0), 9u);  // not started again
  auto last = wire.with(pb::envelope::kRankStatus).back().env.rank_status();
  rank_dies(1, 0);  // time passes (the other rank ended cleanly: restarted)
  EXPECT_EQ(launcher->spawns_of(0), 9u);
  EXPECT_EQ(last.status(), pb::rank_status::STATE_EXITED);
  EXPECT_EQ(last.exit_code(), 137);
  EXPECT_NE(last.detail().find("out-of-memory killer"), std::string::npos) << last.detail();
  EXPECT_NE(last.detail().find("5 rank exits on this node in a row without a completed step"), std::string::npos) << last.detail();
  EXPECT_NE(last.detail().find("not restarting it"), std::string::npos) << last.detail();
  // The other rank goes on; the node stays in the job. An exit with code 0
  // is no death: it does not count.
  EXPECT_EQ(launcher->spawns_of(1), 2u);
  EXPECT_TRUE(st().ranks[1].alive);
  EXPECT_EQ(wire.count(pb::envelope::kLeave), 0u);
  EXPECT_TRUE(events_of<nev::gave_up>().empty());
}

// The OOM killer ends whichever rank is largest: the count is the node's.
TEST_F(node_agent_test, exits_of_different_ranks_count_together) {
  registered();
  for (int i = 0; i < 4; ++i) rank_dies(i % 2, 137);
  EXPECT_FALSE(st().ranks[0].given_up);
  EXPECT_FALSE(st().ranks[1].given_up);
  rank_dies(1, 137);
  EXPECT_FALSE(st().ranks[0].given_up);
  EXPECT_TRUE(st().ranks[1].given_up);
  EXPECT_EQ(st().exits_without_step, 0u);  // rank 0 starts with a fresh count
  EXPECT_EQ(wire.count(pb::envelope::kLeave), 0u);
}

// A node whose every rank was given up leaves the job (its process exits 1
// with the reason: app/node.cpp); 0 turns the limit off.
TEST_F(node_agent_test, a_node_whose_every_rank_was_given_up_leaves_the_job) {
  registered(1);
  st().opts.rank_exit_limit = 2;
  for (int i = 0; i < 2; ++i) rank_dies(0, 139);
  EXPECT_EQ(launcher->spawns_of(0), 2u);
  auto leave = wire.with(pb::envelope::kLeave);
  ASSERT_EQ(leave.size(), 1u);
  EXPECT_NE(leave[0].env.leave().reason().find("every rank given up: rank 0 (pid"), std::string::npos) << leave[0].env.leave().reason();
  EXPECT_NE(leave[0].env.leave().reason().find("SIGSEGV"), std::string::npos) << leave[0].env.leave().reason();
  ASSERT_EQ(events_of<nev::gave_up>().size(), 1u);
  EXPECT_EQ(st().phase, node_phase::leaving);
}

TEST_F(node_agent_test, with_no_exit_limit_a_rank_is_restarted_forever) {
  registered(1);
  st().opts.rank_exit_limit = 0;
  for (int i = 0; i < 12; ++i) rank_dies(0, 137);
  EXPECT_EQ(launcher->spawns_of(0), 13u);
  EXPECT_EQ(wire.count(pb::envelope::kLeave), 0u);
}

TEST_F(node_agent_test, a_rank_that_cannot_be_spawned_is_reported_and_retried) {
  launcher->fail_next = true;
  registered(1);
  EXPECT_EQ(launcher->spawns_of(0), 0u);
  advance(100ms);
  EXPECT_EQ(launcher->spawns_of(0), 1u);
}

TEST_F(node_agent_test, forwards_plans_to_ranks_and_relays_their_reports) {
  registered();
  send(hello(0, launcher->last_pid_of(0)));
  send(hello(1, 4242));  // not the process we started: ignored
  send(plan_for("a", 1, 2));
  EXPECT_EQ(st().phase, node_phase::running);
  auto to_ranks = wire.with(pb::envelope::kGenerationPlan);
  ASSERT_EQ(to_ranks.size(), 1u);
  EXPECT_EQ(to_ranks[0].link, links::ranks);
  EXPECT_EQ(to_ranks[0].peer, "r0");
  EXPECT_EQ(to_ranks[0].env.generation(), 1u);
  EXPECT_EQ(to_ranks[0].env.sender(), "node/a");

  send(hello(1, launcher->last_pid_of(1)));  // a late rank gets the current plan at once
  ASSERT_EQ(wire.count(pb::envelope::kGenerationPlan, "r1"), 1u);
  send(plan_for("a", 1, 2));  // not newer: fenced
  EXPECT_EQ(wire.count(pb::envelope::kGenerationPlan), 2u);

  auto step = from_rank("r0");
  step.env.mutable_step_report()->set_step(17);
  send(step);
  auto relayed = wire.with(pb::envelope::kStepReport);
  ASSERT_EQ(relayed.size(), 1u);
  EXPECT_EQ(relayed[0].link, links::coordinator);
  EXPECT_EQ(relayed[0].env.sender(), "r0");  // the rank's own envelope
  advance(100ms);
  EXPECT_EQ(wire.with(pb::envelope::kHeartbeat).back().env.heartbeat().step(), 17);

  // An exit is reported with the rank's global rank from the plan.
  caf::anon_send(agent, rank_exit_atom::value, launcher->last_pid_of(1), int32_t{139});
  run();
  EXPECT_EQ(wire.with(pb::envelope::kRankStatus).back().env.rank_status().global_rank(), 1);
}

// The process learns what happened from typed events (its metrics and its
// exit), never by reading the envelopes the agent relays; a step report is
// annotated before it is relayed.
TEST_F(node_agent_test, tells_its_process_what_happened_as_typed_events) {
  start();
  EXPECT_TRUE(events.empty());
  send(ack(true, 4));
  ASSERT_EQ(events_of<nev::registered>().size(), 1u);
  EXPECT_EQ(events_of<nev::registered>()[0].job_id, "job");
  EXPECT_EQ(events_of<nev::registered>()[0].node_rank, 4);
  send(hello(0, launcher->last_pid_of(0)));
  send(hello(1, 999999));  // not a process it started: not tracked
  ASSERT_EQ(events_of<nev::rank_started>().size(), 1u);
  EXPECT_EQ(events_of<nev::rank_started>()[0].pid, launcher->last_pid_of(0));
  EXPECT_EQ(events_of<nev::rank_started>()[0].peer, "r0");
  send(plan_for("a", 2, 2));
  send(plan_for("a", 1, 2));  // older: fenced, no event
  ASSERT_EQ(events_of<nev::plan_received>().size(), 1u);
  EXPECT_EQ(events_of<nev::plan_received>()[0].generation, 2u);
  EXPECT_EQ(events_of<nev::plan_received>()[0].world_size, 2);
  auto report = from_rank("r0");
  report.env.mutable_step_report()->set_step(12);
  report.env.mutable_step_report()->set_samples(64);
  send(report);
  ASSERT_EQ(events_of<nev::steps_reported>().size(), 1u);
  EXPECT_EQ(events_of<nev::steps_reported>()[0].report.step(), 12);
  EXPECT_EQ(events_of<nev::steps_reported>()[0].report.node_id(), "annotated for r0");
  auto relayed = wire.with(pb::envelope::kStepReport);
  ASSERT_EQ(relayed.size(), 1u);
  EXPECT_EQ(relayed[0].env.step_report().node_id(), "annotated for r0");
  inbound hb{links::coordinator, "", from_coordinator(2)};
  hb.env.mutable_heartbeat_ack()->set_echoed_sent_steady_s(41.5);
  send(hb);
  ASSERT_EQ(events_of<nev::heartbeat_acked>().size(), 1u);
  EXPECT_EQ(events_of<nev::heartbeat_acked>()[0].echoed_sent_steady_s, 41.5);
  EXPECT_TRUE(events_of<nev::refused>().empty());
  inbound no{links::coordinator, "", from_coordinator(2)};
  no.env.mutable_shutdown()->set_reason("data file 'x' differs");
  no.env.mutable_shutdown()->set_refused(true);
  send(no);
  ASSERT_EQ(events_of<nev::refused>().size(), 1u);
  EXPECT_EQ(events_of<nev::refused>()[0].reason, "data file 'x' differs");
}

TEST_F(node_agent_test, shutdown_stops_ranks_without_restarting_them) {
  registered();
  send(hello(0, launcher->last_pid_of(0)));
  inbound bye{links::coordinator, "", from_coordinator()};
  bye.env.mutable_shutdown()->set_reason("reached train.max_steps = 5");
  send(bye);
  EXPECT_EQ(wire.count(pb::envelope::kShutdown, "r0"), 1u);
  ASSERT_EQ(launcher->terminated.size(), 1u);  // rank 1 never said hello: terminated
  EXPECT_EQ(launcher->terminated[0], launcher->last_pid_of(1));
  caf::anon_send(agent, rank_exit_atom::value, launcher->last_pid_of(0), int32_t{0});
  caf::anon_send(agent, rank_exit_atom::value, launcher->last_pid_of(1), int32_t{143});
  run();
  wire.clear();
  advance(2000ms);
  EXPECT_EQ(launcher->spawned.size(), 2u);
  EXPECT_TRUE(wire.all().empty());  // the agent has quit: no heartbeats, no registers
}

// A rank told to end by the final shutdown that does not exit (the message
// lost, or the process stuck on its way out) is terminated after the
// shutdown's grace, so that the node ends: a scheduler's task of it too.
TEST_F(node_agent_test, a_rank_still_running_after_the_shutdowns_grace_is_terminated) {
  registered();
  send(hello(0, launcher->last_pid_of(0)));
  send(hello(1, launcher->last_pid_of(1)));
  inbound bye{links::coordinator, "", from_coordinator()};
  bye.env.mutable_shutdown()->set_reason("job finished");
  send(bye);
  EXPECT_EQ(wire.count(pb::envelope::kShutdown, "r0"), 1u);
  EXPECT_EQ(wire.count(pb::envelope::kShutdown, "r1"), 1u);
  caf::anon_send(agent, rank_exit_atom::value, launcher->last_pid_of(0), int32_t{0});
  run();
  advance(st().opts.shutdown_grace - 100ms);
  EXPECT_TRUE(launcher->terminated.empty()) << "told to end: the rank has its grace";
  advance(200ms);
  ASSERT_EQ(launcher->terminated.size(), 1u);
  EXPECT_EQ(launcher->terminated[0], launcher->last_pid_of(1)) << "only the rank that still runs";
  caf::anon_send(agent, rank_exit_atom::value, launcher->last_pid_of(1), int32_t{140});
  run();
  wire.clear();
  advance(2000ms);
  EXPECT_TRUE(wire.all().empty());  // the agent has quit
  EXPECT_EQ(launcher->spawned.size(), 2u);
}

TEST_F(node_agent_test, leave_tells_the_coordinator_and_terminates_ranks) {
  registered();
  caf::anon_send(agent, leave_atom::value, std::string("SIGTERM"));
  run();
  auto leave = wire.with(pb::envelope::kLeave);
  ASSERT_EQ(leave.size(), 1u);
  EXPECT_EQ(leave[0].env.leave().reason(), "SIGTERM");
  EXPECT_EQ(launcher->terminated.size(), 2u);
}

// A terminal's Ctrl-C (or SIGTERM to a process group) reaches the node and
// its coordinator together. The node's leave arrives first here; the
// coordinator's stop follows. The ranks must stop with the job (after its
// final checkpoint), not be killed at the leave timeout.
TEST_F(node_agent_test, a_leave_followed_by_the_coordinators_stop_lets_the_ranks_stop_with_the_job) {
  running();
  caf::anon_send(agent, leave_atom::value, std::string("signal 2"));
  run();
  EXPECT_EQ(wire.count(pb::envelope::kLeave), 1u);
  send(job_stop("coordinator stopped by signal 2"));
  EXPECT_EQ(wire.count(pb::envelope::kShutdown, "r0"), 1u);  // relayed
  EXPECT_EQ(wire.count(pb::envelope::kShutdown, "r1"), 1u);
  EXPECT_TRUE(st().job_stopping);
  advance(st().opts.leave_timeout + 100ms);
  EXPECT_TRUE(launcher->terminated.empty());  // not killed at the leave timeout
  // The ranks' final reports still go up while the node leaves.
  auto fin = from_rank("r0");
  fin.env.mutable_rank_status()->set_local_rank(0);
  fin.env.mutable_rank_status()->set_status(pb::rank_status::STATE_FINISHED);
  wire.clear();
  send(fin);
  EXPECT_EQ(wire.count(pb::envelope::kRankStatus), 1u);
  // Bounded: without the coordinator's final shutdown the ranks are stopped.
  advance(st().opts.stop_timeout);
  EXPECT_EQ(launcher->terminated.size(), 2u);
}

// A rank's FINISHED sent while no coordinator listened (a standby taking
// over) or before a new one adopted the generation would be lost: the node
// says it again about once a second while the coordinator talks to it.
TEST_F(node_agent_test, a_finished_ranks_status_is_said_again_about_once_a_second) {
  running();
  auto fin = from_rank("r0");
  fin.env.mutable_rank_status()->set_local_rank(0);
  fin.env.mutable_rank_status()->set_status(pb::rank_status::STATE_FINISHED);
  send(fin);
  wire.clear();
  for (int i = 0; i < 30; ++i) {  // 3 s of heartbeats, the coordinator answering
    send(inbound{links::coordinator, "", from_coordinator(1)});
    advance(st().opts.liveness.heartbeat_interval);
  }
  const auto again = wire.count(pb::envelope::kRankStatus);
  EXPECT_GE(again, 2u);
  EXPECT_LE(again, 4u);
}

// The coordinator's stop first, the node's own signal second: no leave is
// announced (nothing to re-plan), the ranks stop with the job.
TEST_F(node_agent_test, a_signal_during_the_jobs_stop_is_not_a_preemption) {
  running();
  send(job_stop("coordinator stopped by signal 15"));
  caf::anon_send(agent, leave_atom::value, std::string("signal 15"));
  run();
  EXPECT_EQ(wire.count(pb::envelope::kLeave), 0u);
  advance(st().opts.leave_timeout + 100ms);
  EXPECT_TRUE(launcher->terminated.empty());
  inbound bye{links::coordinator, "", from_coordinator(1)};
  bye.env.mutable_shutdown()->set_reason("coordinator stopped by signal 15");
  send(bye);  // the final shutdown: the ranks are told to end
  EXPECT_EQ(wire.count(pb::envelope::kShutdown, "r0"), 2u);
}

// -- a whole cluster in memory ------------------------------------------------

namespace {

// Routes envelopes between the coordinator and node agents with CAF messages,
// and drops them for partitioned nodes (both directions).
struct in_memory_net {
  membership_handle coordinator;
  std::map<std::string, node_agent_handle> agents;  // by peer ("peer-<id>")
  std::set<std::string> partitioned;                // node ids
  wire_log to_ranks;

  outbound coordinator_out() {
    return [this](const std::string&, const std::string& peer, pb::envelope env) {
      if (partitioned.count(peer.substr(5))) return;
      caf::anon_send(agents.at(peer), inbound{links::coordinator, "", std::move(env)});
    };
  }
  outbound agent_out(const std::string& id) {
    auto ranks = to_ranks.sink();
    return [this, id, ranks](const std::string& link, const std::string& peer, pb::envelope env) {
      if (link == links::ranks) return ranks(link, peer, std::move(env));
      if (partitioned.count(id)) return;
      caf::anon_send(coordinator, inbound{links::nodes, "peer-" + id, std::move(env)});
    };
  }
};

}  // namespace

class cluster_test : public ::testing::Test, public caf_fixture {};

TEST_F(cluster_test, a_partitioned_node_is_dropped_then_rejoins_with_its_rank) {
  in_memory_net net;
  coordinator_options co;
  co.membership.min_nodes = 1;
  co.liveness = liveness_options{100ms, 1000ms};
  co.header = envelope_header{1, "job", "coordinator", 1};
  job_options jo;
  jo.max_steps = 100;
  auto job = spawn(job_actor, jo, checkpoint_writer_handle{});
  net.coordinator = spawn(membership_actor, co, net.coordinator_out(), job);
  std::map<std::string, std::shared_ptr<fake_launcher>> launchers;
  for (std::string id : {"a", "b"}) {
    launchers[id] = std::make_shared<fake_launcher>();
    net.agents["peer-" + id] = spawn(node_agent, agent_opts(id, 2), net.agent_out(id), launchers[id]);
    caf::anon_send(net.agents["peer-" + id], start_atom::value);
  }
  auto agent = [&](const std::string& id) -> node_agent_state& { return state_of<node_agent_state>(net.agents.at("peer-" + id)); };
  auto& coord = state_of<membership_actor_state>(net.coordinator);

  // Registered nodes start their ranks; each says hello and, warmed up,
  // STATE_IDLE: only then is it planned.
  advance(100ms);
  for (std::string id : {"a", "b"})
    for (int32_t l = 0; l < 2; ++l) {
      const std::string peer = "rank/" + id + "/" + std::to_string(l);
      auto h = hello(l, launchers[id]->last_pid_of(l));
      h.peer = peer;
      caf::anon_send(net.agents["peer-" + id], h);
      auto idle = from_rank(peer);
      idle.env.mutable_rank_status()->set_status(pb::rank_status::STATE_IDLE);
      idle.env.mutable_rank_status()->set_local_rank(l);
      caf::anon_send(net.agents["peer-" + id], idle);
    }
  advance(300ms);
  ASSERT_TRUE(agent("a").plan);
  EXPECT_EQ(agent("a").phase, node_phase::running);
  EXPECT_EQ(agent("a").node_rank, 0);
  EXPECT_EQ(agent("b").node_rank, 1);
  EXPECT_EQ(agent("b").plan->generation(), 1u);
  EXPECT_EQ(agent("b").plan->world_size(), 4);

  net.partitioned.insert("b");
  advance(1500ms);
  ASSERT_EQ(coord.lost.size(), 1u);
  EXPECT_EQ(coord.lost[0].peer.str(), "b");
  EXPECT_EQ(agent("a").plan->generation(), 2u);
  EXPECT_EQ(agent("a").plan->world_size(), 2);
  // a's ranks agree on their state in generation 2 (READY): they hold it.
  for (int32_t l = 0; l < 2; ++l) {
    auto ready = from_rank("rank/a/" + std::to_string(l));
    ready.env.set_generation(2);
    ready.env.mutable_rank_status()->set_status(pb::rank_status::STATE_READY);
    ready.env.mutable_rank_status()->set_local_rank(l);
    caf::anon_send(net.agents["peer-a"], ready);
  }
  run();
  EXPECT_EQ(agent("b").phase, node_phase::registering);  // b noticed too
  EXPECT_EQ(agent("b").plan->generation(), 1u);          // and never heard of generation 2
  EXPECT_EQ(launchers["b"]->spawned.size(), 2u);         // its ranks were not restarted

  net.partitioned.clear();
  advance(1000ms);
  EXPECT_EQ(agent("b").phase, node_phase::running);
  EXPECT_EQ(agent("b").node_rank, 1);
  EXPECT_EQ(agent("b").plan->generation(), 3u);
  EXPECT_EQ(agent("a").plan->generation(), 3u);
  EXPECT_EQ(agent("a").plan->world_size(), 4);
  EXPECT_EQ(agent("a").plan->state_root(), 0);
  EXPECT_EQ(coord.members.state().current->generation, 3u);
}

TEST_F(node_agent_test, a_rank_that_falls_silent_is_killed_not_asked_to_end) {
  registered();
  send(hello(0, launcher->last_pid_of(0)));
  send(hello(1, launcher->last_pid_of(1)));
  // Rank 1 keeps talking, rank 0 falls silent past five heartbeat timeouts.
  for (int i = 0; i < 60; ++i) {
    auto beat = from_rank("r1");
    beat.env.mutable_heartbeat()->set_seq(static_cast<uint64_t>(i));
    send(beat);
    inbound ack{links::coordinator, "", from_coordinator()};
    ack.env.mutable_heartbeat_ack()->set_seq(static_cast<uint64_t>(i));
    send(ack);
    advance(100ms);
  }
  ASSERT_EQ(launcher->killed.size(), 1u);
  EXPECT_EQ(launcher->killed[0], launcher->last_pid_of(0));
  EXPECT_TRUE(launcher->terminated.empty());
}

TEST_F(node_agent_test, a_standby_node_says_so_in_every_registration) {
  start();
  EXPECT_FALSE(wire.with(pb::envelope::kRegisterNode)[0].env.register_node().standby());
  auto o = agent_opts("s", 2);
  o.standby = true;  // --standby-node
  auto standby = spawn(node_agent, o, wire.sink(), launcher);
  caf::anon_send(standby, start_atom::value);
  run();
  const auto sent = wire.with(pb::envelope::kRegisterNode);
  ASSERT_EQ(sent.size(), 2u);
  EXPECT_EQ(sent[1].env.register_node().node_id(), "s");
  EXPECT_TRUE(sent[1].env.register_node().standby());
  caf::anon_send_exit(standby, caf::exit_reason::user_shutdown);
  run();
}
