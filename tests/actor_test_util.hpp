#pragma once
// A deterministic CAF actor system for GoogleTest: CAF's test coordinator
// (scheduler.policy = testing) runs actors only when told, and its clock moves
// only when told. Like caf::test::test_coordinator_fixture, without
// caf/test/dsl.hpp (its CAF_CHECK macros need CAF's own test engine).
// No LibTorch includes here.
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "caf/actor_cast.hpp"
#include "caf/actor_system.hpp"
#include "caf/actor_system_config.hpp"
#include "caf/scheduler/test_coordinator.hpp"
#include "caf/send.hpp"
#include "caf/stateful_actor.hpp"
#include "caf/typed_actor.hpp"

namespace dtactor::test_support {

class caf_fixture {
 public:
  caf_fixture() : sys_(init(cfg_)), sched(dynamic_cast<caf::scheduler::test_coordinator&>(sys_.scheduler())) {
    sched.clock().current_time += std::chrono::hours(1);  // a clock that is not at 0
  }

  ~caf_fixture() {
    for (auto& a : spawned_) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    sched.run();
  }

  caf::actor_system& sys() { return sys_; }

  // The handle the actor's function declares: caf::actor, or a typed one.
  template <class F, class... Ts>
  auto spawn(F fun, Ts&&... xs) {
    auto a = sys_.spawn(fun, std::forward<Ts>(xs)...);
    spawned_.push_back(caf::actor_cast<caf::actor>(a));
    return a;
  }

  // Runs every actor until no mailbox holds a message (timers do not fire).
  size_t run() { return sched.run(); }

  // Moves the clock by `total` in increments of `step`, firing due timers and
  // running actors after each increment, as real time would.
  void advance(std::chrono::milliseconds total, std::chrono::milliseconds step = std::chrono::milliseconds(10)) {
    for (auto done = std::chrono::milliseconds(0); done < total; done += step) {
      sched.clock().advance_time(std::min(step, total - done));
      sched.run();
    }
  }

  clock_time now() const { return sched.clock().now(); }

  template <class State>
  State& state_of(const caf::actor& a) {
    auto* ptr = caf::actor_cast<caf::abstract_actor*>(a);
    return dynamic_cast<caf::stateful_actor<State>&>(*ptr).state;
  }

  template <class State, class... Sigs>
  State& state_of(const caf::typed_actor<Sigs...>& a) {
    auto* ptr = caf::actor_cast<caf::abstract_actor*>(a);
    return dynamic_cast<typename caf::typed_actor<Sigs...>::template stateful_base<State>&>(*ptr).state;
  }

 private:
  static caf::actor_system_config& init(caf::actor_system_config& cfg) {
    cfg.set("scheduler.policy", caf::atom("testing"));
    cfg.set("logger.file-verbosity", caf::atom("quiet"));
    cfg.set("logger.console-verbosity", caf::atom("quiet"));
    add_message_types(cfg);
    return cfg;
  }

  caf::actor_system_config cfg_;
  caf::actor_system sys_;
  std::vector<caf::actor> spawned_;

 public:
  caf::scheduler::test_coordinator& sched;
};

// Captures what actors send through `outbound`.
struct sent_envelope {
  std::string link;
  std::string peer;
  pb::envelope env;
};

class wire_log {
 public:
  outbound sink() {
    auto log = log_;
    return [log](const std::string& link, const std::string& peer, pb::envelope env) { log->push_back({link, peer, std::move(env)}); };
  }
  std::vector<sent_envelope>& all() { return *log_; }
  // Sent envelopes with this body, in order.
  std::vector<sent_envelope> with(pb::envelope::BodyCase body, const std::string& peer = "") const {
    std::vector<sent_envelope> out;
    for (const auto& s : *log_)
      if (s.env.body_case() == body && (peer.empty() || s.peer == peer)) out.push_back(s);
    return out;
  }
  size_t count(pb::envelope::BodyCase body, const std::string& peer = "") const { return with(body, peer).size(); }
  void clear() { log_->clear(); }

 private:
  std::shared_ptr<std::vector<sent_envelope>> log_ = std::make_shared<std::vector<sent_envelope>>();
};

inline pb::envelope node_envelope(const std::string& node_id, uint64_t incarnation, uint64_t generation = 0) {
  envelope_header h;
  h.job_id = "job";
  h.sender = sender_id::of_node(node_id).to_string();
  h.incarnation = incarnation;
  return make_envelope(h, generation);
}

inline inbound register_from(const std::string& node_id, int32_t nproc, uint64_t incarnation = 1) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, incarnation)};
  auto* r = in.env.mutable_register_node();
  r->set_node_id(node_id);
  r->set_advertise_addr(node_id + ".local");
  r->set_nproc(nproc);
  return in;
}

inline inbound heartbeat_from(const std::string& node_id, uint64_t seq, uint64_t incarnation = 1) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, incarnation)};
  in.env.mutable_heartbeat()->set_seq(seq);
  return in;
}

}  // namespace dtactor::test_support
