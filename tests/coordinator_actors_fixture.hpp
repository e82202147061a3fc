// The coordinator's membership and job actors under CAF's deterministic test
// coordinator (no sleeps; the clock moves only in advance()): the fixture
// and message builders the coordinator_*_test.cpp files share.
#pragma once

#include "actors/membership_actor.hpp"
#include "actors/job_actor.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <variant>

#include "actor_test_util.hpp"
#include "net/plan_layout.hpp"

namespace dtactor::coordinator_test {

using namespace dtactor::test_support;
using namespace std::chrono_literals;

inline coordinator_options coord_opts(int32_t min_nodes, int32_t max_nodes = 64) {
  coordinator_options o;
  o.membership.min_nodes = min_nodes;
  o.membership.max_nodes = max_nodes;
  o.liveness = liveness_options{100ms, 1000ms};
  o.header = envelope_header{1, "job", "coordinator", 1};
  o.store_host = "coord.local";
  o.store_port = 29500;
  return o;
}

// register_node of a node whose ranks are all up and warmed.
inline inbound joined(const std::string& node_id, int32_t nproc, uint64_t incarnation = 1) {
  auto in = register_from(node_id, nproc, incarnation);
  for (int32_t l = 0; l < nproc; ++l) in.env.mutable_register_node()->add_ready_ranks(l);
  return in;
}

inline inbound status_from(const std::string& node_id, int32_t local_rank, pb::rank_status::state state, uint64_t generation = 0, uint64_t incarnation = 1) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, incarnation, generation)};
  in.env.mutable_rank_status()->set_local_rank(local_rank);
  in.env.mutable_rank_status()->set_status(state);
  return in;
}

inline inbound leave_from(const std::string& node_id, const std::string& reason, uint64_t incarnation = 1) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, incarnation)};
  in.env.mutable_leave()->set_reason(reason);
  return in;
}

// Generation `g` (a's two ranks, then b's one) as node `only` reports it
// after a coordinator restart: its own slice of it.
inline pb::generation_plan running_plan(uint64_t g, const std::string& only) {
  pb::generation_plan p;
  p.set_generation(g);
  p.set_world_size(3);
  p.set_state_root(0);
  add_node_ranks(p, 2);
  add_node_ranks(p, 1);
  const std::vector<std::pair<std::string, int32_t>> slots{{"a", 0}, {"a", 1}, {"b", 0}};
  for (int32_t r = 0; r < 3; ++r) {
    if (slots[r].first != only) continue;
    auto* a = p.add_ranks();
    a->set_node_id(slots[r].first);
    a->set_local_rank(slots[r].second);
    a->set_global_rank(r);
  }
  return p;
}

inline inbound joined_in(const std::string& node_id, int32_t nproc, uint64_t g) {
  auto in = joined(node_id, nproc);
  *in.env.mutable_register_node()->mutable_current_plan() = running_plan(g, node_id);
  in.env.mutable_register_node()->set_last_generation(g);
  in.env.set_generation(g);
  return in;
}

inline void expect_plan(const pb::generation_plan& p, uint64_t generation, int32_t world_size, const std::string& cause, bool drain) {
  EXPECT_EQ(p.generation(), generation);
  EXPECT_EQ(p.world_size(), world_size);
  EXPECT_EQ(to_string(cause_of(p)), cause);
  EXPECT_EQ(p.drain(), drain);
}

inline inbound step_from(const std::string& node_id, int32_t global_rank, int64_t step, uint64_t generation) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  in.env.mutable_step_report()->set_step(step);
  in.env.mutable_step_report()->set_global_rank(global_rank);
  return in;
}

inline inbound finished_from(const std::string& node_id, int32_t global_rank, int64_t step, uint64_t generation, const std::string& digest) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  auto* s = in.env.mutable_rank_status();
  s->set_status(pb::rank_status::STATE_FINISHED);
  s->set_global_rank(global_rank);
  s->set_step(step);
  s->set_detail(digest);
  return in;
}

// A rank's report that it stored the byte ranges `ranges` of the checkpoint
// at `step` (of `state_bytes`), a part each ("part-<step>-<rank>" for the
// first, "part-<step>-<rank>.<k>" for the k-th).
inline inbound checkpoint_parts_from(const std::string& node_id, int64_t step, uint64_t generation, int32_t rank, int32_t world,
                                     const std::vector<std::pair<uint64_t, uint64_t>>& ranges, uint64_t state_bytes) {
  inbound in{links::nodes, "peer-" + node_id, node_envelope(node_id, 1, generation)};
  auto* w = in.env.mutable_checkpoint_written();
  w->set_step(step);
  w->set_global_rank(rank);
  w->set_world_size(world);
  w->set_stall_s(0.01 * (rank + 1));
  w->set_write_s(0.5 * (rank + 1));
  for (size_t k = 0; k < ranges.size(); ++k) {
    auto* p = w->add_parts();
    p->set_name("part-" + std::to_string(step) + "-" + std::to_string(rank) + (k == 0 ? "" : "." + std::to_string(k)));
    p->set_offset(ranges[k].first);
    p->set_size(ranges[k].second - ranges[k].first);
    p->set_rank(rank);
  }
  if (rank == 0) {
    pb::checkpoint_meta m;
    m.set_step(step);
    m.set_state_bytes(state_bytes);
    w->set_meta(m.SerializeAsString());
  }
  return in;
}

// A rank's report that it stored its part of the checkpoint at `step`
// (1000 state bytes split evenly), or (with `error`) that it could not.
inline inbound checkpoint_from(const std::string& node_id, int64_t step, uint64_t generation, int32_t rank = 0, int32_t world = 1,
                               const std::string& error = "") {
  const uint64_t share = static_cast<uint64_t>(1000 / world), at = share * static_cast<uint64_t>(rank);
  auto in = checkpoint_parts_from(node_id, step, generation, rank, world, {{at, at + share}}, 1000);
  if (!error.empty()) {
    in.env.mutable_checkpoint_written()->clear_parts();
    in.env.mutable_checkpoint_written()->clear_meta();
    in.env.mutable_checkpoint_written()->set_error(error);
  }
  return in;
}

// Waits for the job's end as the coordinator's main thread does.
struct waiter_state {
  std::shared_ptr<int> code;
  static inline const char* name = "test.waiter";
};
inline caf::behavior waiter(caf::stateful_actor<waiter_state>* self, job_handle job, std::shared_ptr<int> code) {
  self->state.code = code;
  self->send(job, wait_atom::value);
  return {[=](done_atom, int c) { *self->state.code = c; }};
}

// The exit code the job ends with (-1 until it ended), as the main thread sees it.
inline std::shared_ptr<int> await_end(caf_fixture& f, const job_handle& job) {
  auto code = std::make_shared<int>(-1);
  f.spawn(waiter, job, code);
  return code;
}

template <class T>
inline std::ptrdiff_t index_of(const std::vector<ev::event>& events) {
  auto it = std::find_if(events.begin(), events.end(), [](const ev::event& e) { return std::holds_alternative<T>(e); });
  return it == events.end() ? -1 : it - events.begin();
}


class coordinator_actors : public ::testing::Test, public caf_fixture {
 protected:
  std::vector<int64_t> kept;  // what the commit says the store keeps (empty: not known)

  void start(coordinator_options o, int64_t max_steps = 100) {
    job_options jo;
    jo.max_steps = max_steps;
    jo.header = o.header;
    jo.events = [this](const ev::event& e) { events.push_back(e); };
    jo.stop_timeout = 30s;
    if (!o.events) o.events = jo.events;
    if (with_writer) {
      checkpoint_writer_options wo;
      wo.events = jo.events;
      wo.commit = [this](pb::checkpoint_meta m) -> result<saved_checkpoint> {
        if (fail_saves) return make_error("disk full");
        saved.emplace_back(m.generation(), m.step());
        manifests.push_back(m);
        return saved_checkpoint{"ckpt-" + std::to_string(m.step()), static_cast<int64_t>(m.state_bytes()), 0.5, kept};
      };
      writer = spawn(checkpoint_writer, wo);
    }
    job = spawn(job_actor, jo, writer);
    members = spawn(membership_actor, o, wire.sink(), job);
    caf::anon_send(job, members_atom::value, members);
    if (writer) caf::anon_send(writer, members_atom::value, members);
    run();
  }

  // a and b (one rank each) in generation 1, heartbeating.
  void start_two_with_suspect_timeout(std::chrono::milliseconds suspect) {
    auto o = coord_opts(1);
    o.liveness.suspect_timeout = suspect;
    o.membership.suspect_timeout = suspect;
    start(o);
    send(joined("a", 1));
    send(joined("b", 1));
    keep_alive({"a", "b"}, 200ms);
  }

  // Events of this kind, in order.
  template <class T>
  std::vector<T> of() const {
    std::vector<T> out;
    for (const auto& e : events)
      if (const auto* x = std::get_if<T>(&e)) out.push_back(*x);
    return out;
  }

  // Heartbeats from `ids` every 100 ms for `total`.
  void keep_alive(std::initializer_list<std::string> ids, std::chrono::milliseconds total) {
    for (auto done = 0ms; done < total; done += 100ms) {
      for (const auto& id : ids) send(heartbeat_from(id, seq++));
      advance(std::min(100ms, total - done));
    }
  }

  // The leader of a pair (opts.orphaned set, saying into `said`; orphaned
  // 2 s after the last node was heard), a and b trained in generation 1.
  void start_a_pair_member_with_a_and_b(std::vector<std::string>& said) {
    auto o = coord_opts(1);
    o.orphaned = [&said](const std::string& why) { said.push_back(why); };
    o.orphan_after = 2000ms;
    start(o);
    send(joined("a", 1));
    send(joined("b", 1));
    keep_alive({"a", "b"}, 300ms);
    trained();
  }

  pb::generation_plan last_plan(const std::string& peer) { return wire.with(pb::envelope::kGenerationPlan, peer).back().env.generation_plan(); }

  // Nodes here got every plan sent to them: a heartbeat built without a
  // generation from a node of the current plan carries that plan's (as a
  // node's does), unless a test turns that off to play a node that lost
  // its plan.
  bool beats_follow_plans = true;

  void send(const inbound& in) {
    const auto& cur = ms().members.state().current;
    const node_id from{in.env.has_heartbeat() && in.peer.rfind("peer-", 0) == 0 ? in.peer.substr(5) : std::string()};
    if (beats_follow_plans && cur && !from.empty() && in.env.generation() == 0 &&
        std::any_of(cur->nodes.begin(), cur->nodes.end(), [&](const plan_node& n) { return n.node_id == from; })) {
      auto stamped = in;
      stamped.env.set_generation(cur->generation);
      caf::anon_send(members, stamped);
    } else {
      caf::anon_send(members, in);
    }
    run();
  }

  membership_actor_state& ms() { return state_of<membership_actor_state>(members); }

  // Every rank of the current plan reports READY in its generation (each
  // then holds that generation's state), as a generation that trained.
  void trained() {
    if (!ms().members.state().current) return;
    const plan cur = *ms().members.state().current;
    for (const auto& r : cur.ranks) {
      const auto* n = ms().members.find(r.node_id);
      send(status_from(r.node_id.str(), r.local_rank, pb::rank_status::STATE_READY, cur.generation, n ? n->incarnation : 1));
    }
  }
  job_actor_state& js() { return state_of<job_actor_state>(job); }

  wire_log wire;
  job_handle job;
  membership_handle members;
  std::vector<ev::event> events;
  uint64_t seq = 0;
  bool with_writer = false;
  bool fail_saves = false;
  checkpoint_writer_handle writer;
  std::vector<std::pair<uint64_t, int64_t>> saved;  // (generation, step) the fake store committed
  std::vector<pb::checkpoint_meta> manifests;        // what it was given
};


}  // namespace dtactor::coordinator_test
