#include "actors/membership_actor.hpp"

#include <algorithm>
#include <optional>

#include "actors/wire_enums.hpp"
#include "caf/stateful_actor.hpp"
#include "base/printable.hpp"
#include "base/unix_time.hpp"
#include "net/plan_layout.hpp"

namespace dtactor {

namespace {

// The node id of a node's envelope; empty when the sender is not a node.
node_id node_id_of(const inbound& in) { return in.from.who == sender_id::role::node ? node_id{in.from.node} : node_id{}; }


using membership_self = membership_handle::stateful_pointer<membership_actor_state>;

uint64_t current_generation(const membership_actor_state& st) { return st.members.state().current ? st.members.state().current->generation : 0; }

// The interval this coordinator asks its nodes to heartbeat at, for its
// number of members (actors/liveness.hpp): members that beat a relay, and
// nodes that beat the coordinator (every node while relays are not active,
// else about one a relay group).
std::chrono::milliseconds member_interval(const membership_actor_state& st) {
  return heartbeat_interval_for(st.opts.liveness, st.members.state().nodes.size());
}
std::chrono::milliseconds direct_interval(const membership_actor_state& st) {
  return heartbeat_interval_for(st.opts.liveness, st.relays.direct_beaters(st.members.state().nodes.size()));
}

uint32_t asked_ms(const membership_actor_state& st, std::chrono::milliseconds every) {
  return every > st.opts.liveness.heartbeat_interval ? static_cast<uint32_t>(every.count()) : 0;
}

// Silence judged at the longest interval between a node's signs of life:
// the members' interval, and through a relay that plus the relay's own
// (the suspect timeout then covers a member's failover from a relay that
// died: actors/relays.hpp). A closed connection's grace stays three member
// intervals: a live member whose connection to the coordinator dropped is
// still heard through its relay, a member and a relay interval later.
liveness_options judged_liveness(const membership_actor_state& st) {
  auto o = liveness_at(st.opts.liveness, member_interval(st) + (st.relays.active() ? direct_interval(st) : std::chrono::milliseconds(0)));
  o.closed_grace = liveness_at(st.opts.liveness, member_interval(st)).closed_grace;
  return o;
}

// The relay of `id`'s group (none: it beats the coordinator).
std::optional<relay_directory::relay> relay_of(membership_actor_state& st, const node_id& id) {
  const auto* n = st.members.find(id);
  if (!n) return std::nullopt;
  return st.relays.relay_for(n->node_rank, [&](const node_id& r, int32_t rank) {
    const auto* m = st.members.find(r);
    return m && m->node_rank == rank;
  });
}

// What a node is told of where to beat, and how often: a relay beats the
// coordinator at the direct interval; every other node, its relay or (in
// a group without one) the coordinator, at the members' interval.
void tell_relay(membership_actor_state& st, const node_id& id, pb::relay_assignment* out, uint32_t* interval_ms) {
  const auto r = relay_of(st, id);
  *out = to_proto(r, asked_ms(st, member_interval(st)));
  *interval_ms = asked_ms(st, r && r->id == id ? direct_interval(st) : member_interval(st));
}

void send_to_node(membership_self self, const std::string& peer, pb::envelope env) { self->state.out(links::nodes, peer, std::move(env)); }

void emit(membership_self self, ev::event e) {
  if (self->state.opts.events) self->state.opts.events(e);
}

void node_lost(membership_self self, const node_id& id, ev::loss_cause cause, double detected_after_s) {
  auto& st = self->state;
  emit(self, ev::node_lost{id.str(), cause, detected_after_s});
  if (st.job) self->send(st.job, lost_atom::value, id.str(), detected_after_s);
}

void quarantined(membership_self self, const node_id& id, const std::string& reason) {
  log_line(self->state.opts.log, reason);
  emit(self, ev::node_quarantined{id.str(), reason});
}

void plan_if_due(membership_self self, clock_time now);

// A rank became ready: judge once the mailbox's earlier messages are read
// (a burst of readiness is one judgement), not at the next tick.
void decide_soon(membership_self self) {
  if (self->state.decide_pending) return;
  self->state.decide_pending = true;
  self->send(self, decide_atom::value);
}

// Whether a restarted or new leader is waiting for the nodes of the
// generation they report (membership's adoption_gap).
bool adopting(const membership_state& s) { return !s.current && s.reported_plan; }

void on_register(membership_self self, const inbound& in) {
  auto& st = self->state;
  const auto& r = in.env.register_node();
  const node_id id{r.node_id()};
  node_registration reg{
      id,         r.advertise_addr(), r.nproc(), in.env.incarnation(), in.peer, {r.ready_ranks().begin(), r.ready_ranks().end()},
      r.last_generation(), std::nullopt};
  if (r.has_current_plan() && r.current_plan().generation() > 0) reg.current_plan = from_proto(r.current_plan());
  reg.standby = r.standby();
  auto a = st.members.admit(reg, self->clock().now());
  auto env = make_envelope(st.opts.header, current_generation(st));
  auto* ack = env.mutable_register_ack();
  ack->set_accepted(a.accepted);
  ack->set_reason(a.reason);
  ack->set_node_rank(a.node_rank);
  ack->set_job_id(st.opts.header.job_id);
  if (a.accepted) {
    ack->set_config_toml(st.opts.config_toml);
    ack->set_checkpoint_store(st.opts.checkpoint_store);
    ack->set_module_object(st.opts.module_object);
    ack->set_module_digest(st.opts.module_digest);
    st.relays.set(id, a.node_rank, r.relay_endpoint());
    st.relays.update(st.members.state().nodes.size());
    uint32_t every = 0;
    tell_relay(st, id, ack->mutable_relay(), &every);
    ack->set_heartbeat_interval_ms(every);
  }
  if (a.restarted) {
    log_line(st.opts.log, "node '" + r.node_id() + "' restarted (new incarnation); its previous process is lost");
    node_lost(self, id, ev::loss_cause::restarted, a.silent_s);
    if (a.quarantined) quarantined(self, id, st.members.state().flaps.at(id).reason);
  }
  if (!a.accepted)
    log_line(st.opts.log, "refused node '" + printable(r.node_id()) + "': " + printable(a.reason, 0));
  else if (a.joined) {
    log_line(st.opts.log, "node '" + r.node_id() + "' joined as node rank " + std::to_string(a.node_rank) + " (nproc " + std::to_string(r.nproc()) +
                              (a.rejoined ? ", its previous rank)" : ")"));
    emit(self, ev::node_joined{r.node_id(), in.peer, printable(r.advertise_addr()), r.metrics_port()});
  }
  if (a.accepted) {
    st.peers[id] = in.peer;
    st.draining.erase(id);
  }
  send_to_node(self, in.peer, std::move(env));
  // The registration that completes the generation's members adopts it
  // now, not at the next tick.
  if (a.accepted && adopting(st.members.state())) plan_if_due(self, self->clock().now());
}

// A member of the current plan that still beats with an older generation
// lost its plan (sent on a connection that had gone stale, whose reconnect
// dropped what was queued): its slice again, once per resend interval.
void resend_plan_if_lost(membership_self self, const node_id& id, uint64_t its_generation, const std::string& peer,
                         std::optional<clock_time> heard_at = std::nullopt) {
  auto& st = self->state;
  const auto& cur = st.members.state().current;
  if (!st.last_plan || !cur || its_generation >= cur->generation || st.last_plan->common.generation() != cur->generation) return;
  const auto now = self->clock().now();
  const auto every = st.opts.liveness.heartbeat_timeout / 4;
  // A relayed beat counts from when the relay heard it.
  if (heard_at.value_or(now) - st.last_plan->at < every) return;
  auto it = st.last_plan->resent.find(id);
  if (it != st.last_plan->resent.end() && now - it->second < every) return;
  const auto n = std::find_if(cur->nodes.begin(), cur->nodes.end(), [&](const plan_node& x) { return x.node_id == id; });
  if (n == cur->nodes.end()) return;
  if (it == st.last_plan->resent.end())
    log_line(st.opts.log, "node '" + id.str() + "' is still at generation " + std::to_string(its_generation) + " of " + std::to_string(cur->generation) +
                              ": its plan is sent again");
  st.last_plan->resent[id] = now;
  auto mine = st.last_plan->common;
  add_ranks_of(*mine.mutable_generation_plan(), *n, ranks_per_host(*cur).at(n->advertise_addr));
  send_to_node(self, peer, std::move(mine));
  ++st.plans_sent;
  ++st.plans_resent;
}

// A relay's beat: each member it heard is a sign of life at that beat's
// age; those that are no members are named in the ack.
std::vector<std::string> take_relayed(membership_self self, const node_id& node_id_of_relay, const pb::heartbeat& hb) {
  auto& st = self->state;
  std::vector<std::string> refused;
  const auto now = self->clock().now();
  for (const auto& r : hb.relayed()) {
    const node_id id{r.node_id()};
    const auto seen_at = now - std::chrono::milliseconds(std::min<uint32_t>(r.age_ms(), 3600000));
    if (!st.members.sighted(id, r.incarnation(), seen_at, st.opts.liveness.heartbeat_interval)) {
      refused.push_back(r.node_id());
      continue;
    }
    ++st.relayed_beats;
    st.relayed_by[id] = node_id_of_relay;
    if (auto p = st.peers.find(id); p != st.peers.end()) resend_plan_if_lost(self, id, r.generation(), p->second, seen_at);
  }
  return refused;
}

void on_heartbeat(membership_self self, const inbound& in) {
  auto& st = self->state;
  auto id = node_id_of(in);
  auto env = make_envelope(st.opts.header, current_generation(st));
  if (st.members.touch(id, in.env.incarnation(), self->clock().now(), in.peer)) {
    resend_plan_if_lost(self, id, in.env.generation(), in.peer);
    st.relayed_by.erase(id);  // heard directly
    const auto refused = take_relayed(self, id, in.env.heartbeat());
    if (in.env.heartbeat().no_ack() && refused.empty()) return;  // the node asks for one often enough
    auto* ack = env.mutable_heartbeat_ack();
    ack->set_seq(in.env.heartbeat().seq());
    ack->set_echoed_sent_steady_s(in.env.heartbeat().sent_steady_s());
    uint32_t every = 0;
    tell_relay(st, id, ack->mutable_relay(), &every);
    ack->set_interval_ms(every);
    for (const auto& r : refused) ack->add_refused(r);
  } else {
    ++st.refused_heartbeats;
    if (auto d = st.draining.find(id); d != st.draining.end()) d->second = self->clock().now();
    auto* ack = env.mutable_register_ack();
    ack->set_accepted(false);
    ack->set_node_rank(-1);
    ack->set_job_id(st.opts.header.job_id);
    ack->set_reason("node '" + id.str() + "' is not a member (declared lost, restarted, or the coordinator restarted); register again");
  }
  send_to_node(self, in.peer, std::move(env));
}

void on_leave(membership_self self, const inbound& in) {
  auto& st = self->state;
  auto id = node_id_of(in);
  const auto* n = st.members.find(id);
  if (!n || n->incarnation != in.env.incarnation()) return;
  st.members.remove(id, self->clock().now(), departure::left);
  st.last_loss_silent = false;
  if (in.env.leave().draining()) st.draining[id] = self->clock().now();
  const std::string reason = printable(in.env.leave().reason());
  log_line(st.opts.log, "node '" + id.str() + "' left: " + reason);
  emit(self, ev::node_left{id.str(), reason});
  if (in.env.leave().has_notice()) {
    const auto& n = in.env.leave().notice();
    ev::preemption_notice e;
    e.node = id.str();
    e.cloud = printable(n.cloud());
    e.announced_time = printable(n.announced_time());
    e.announced_unix_s = n.announced_unix_s();
    e.at_step = in.env.leave().at_step();
    e.notice_s = n.announced_unix_s() - n.noticed_unix_s();
    e.left_before_s = n.announced_unix_s() - unix_time_now();
    emit(self, e);
  }
}

// A node that must not train (its data differs, its ranks cannot start):
// out of the membership, told why in a shutdown (its log and exit say it),
// journaled; the job goes on without it.
void refuse_node(membership_self self, const node_id& id, const std::string& why) {
  auto& st = self->state;
  log_line(st.opts.log, why);
  emit(self, ev::job_error{id.str(), why});
  st.members.remove(id, self->clock().now(), departure::left);
  auto env = make_envelope(st.opts.header, current_generation(st));
  env.mutable_shutdown()->set_reason(why);
  env.mutable_shutdown()->set_refused(true);
  if (auto p = st.peers.find(id); p != st.peers.end()) st.out(links::nodes, p->second, std::move(env));
}

// Readiness and failures of a node's ranks. The node agent relays them as
// "node/<id>" (its incarnation) or passes a rank's own envelope on as
// "rank/<id>/<local_rank>" (the rank's incarnation: the node's is assumed).
// True when a collective failure starts suspicion.
bool on_rank_status(membership_self self, const inbound& in) {
  auto& st = self->state;
  const auto& s = in.env.rank_status();
  // Peer text from here on is printable (logs, journal, labels).
  node_id id{printable(node_id_of(in).str())};
  uint64_t incarnation = in.env.incarnation();
  if (in.from.who == sender_id::role::rank) {
    id = node_id{printable(in.from.node)};
    if (const auto* n = st.members.find(id)) incarnation = n->incarnation;
  }
  if (id.empty()) return false;
  auto now = self->clock().now();
  switch (s.status()) {
    case pb::rank_status::STATE_IDLE:
      for (const auto& [path, digest] : s.data_digests()) {
        auto [ref, first] = st.opts.data_digests.emplace(path, digest);
        if (first || ref->second == digest) continue;
        refuse_node(self, id, "data file '" + printable(path) + "' on node '" + id.str() + "' differs from the coordinator's (" + printable(digest) +
                                  ", expected " + printable(ref->second) + "): the node is refused");
        return false;
      }
      if (st.members.set_rank_ready(id, incarnation, s.local_rank(), true, now)) decide_soon(self);
      break;
    case pb::rank_status::STATE_READY:
      st.members.set_rank_ready(id, incarnation, s.local_rank(), true, now);
      st.members.note_synced(id, incarnation, s.local_rank(), in.env.generation());
      break;
    case pb::rank_status::STATE_EXITED:
      if (st.members.set_rank_ready(id, incarnation, s.local_rank(), false, now))
        log_line(st.opts.log, "rank " + std::to_string(s.local_rank()) + " of node '" + id.str() + "' exited (code " + std::to_string(s.exit_code()) + ")" +
                                  (s.spare_takes_over() ? "; a warm spare takes its place" : ""));
      // The node handed the slot to a warm spare, already loaded: ready
      // again at once (a new process), so that the next plan, made now,
      // takes it in instead of shrinking first and growing a settle later.
      if (s.spare_takes_over()) st.members.set_rank_ready(id, incarnation, s.local_rank(), true, now);
      break;
    case pb::rank_status::STATE_FAILED:
      if (in.env.generation() == 0 && s.global_rank() < 0) {
        // The warm-up failed (the model or the data could not be loaded):
        // no generation can use this node as it is.
        refuse_node(self, id, "node '" + id.str() + "' cannot start rank " + std::to_string(s.local_rank()) + ": " + printable(s.detail(), printable_max_detail_chars));
        return false;
      }
      if (st.members.report_failure(in.env.generation(), id, s.local_rank(), now)) {
        log_line(st.opts.log, "rank " + std::to_string(s.local_rank()) + " of node '" + id.str() + "' failed in generation " +
                                  std::to_string(in.env.generation()) + " (" + printable(s.detail(), printable_max_detail_chars) +
                                  "); suspecting silent nodes and closed connections");
        return true;
      }
      break;
    default:
      break;
  }
  return false;
}

// A rank refused the checkpoint it was to load: marked bad for the job,
// journaled once. Returns the job's failure line when none is left (and
// plans nothing more).
std::optional<std::string> on_checkpoint_refused(membership_self self, const inbound& in) {
  auto& st = self->state;
  const auto& s = in.env.rank_status();
  if (s.status() != pb::rank_status::STATE_FAILED || s.failure() != pb::rank_status::FAILURE_CHECKPOINT) return std::nullopt;
  const std::string who = "rank " + std::to_string(s.global_rank()) + " on node '" + in.from.node_name() + "'";
  auto r = refuse_checkpoint(st.checkpoints, s.refused_checkpoint_step(), who, s.detail());
  if (r.newly_bad) {
    if (!r.exhausted) log_line(st.opts.log, r.line);  // else the job's failure says it
    ev::checkpoint_refused e;
    e.step = s.refused_checkpoint_step();
    e.rank = s.global_rank();
    e.node = in.from.node_name();
    e.generation = in.env.generation();
    e.reason = s.detail();
    e.fallback_step = r.fallback;
    emit(self, e);
  }
  if (!r.exhausted || st.stopping) return std::nullopt;
  st.stopping = true;
  return r.line;
}

void broadcast_plan(membership_self self, const plan& p, int64_t start_step) {
  auto& st = self->state;
  // A newer generation was planned while we waited for the start step.
  if (current_generation(st) != p.generation) return;
  auto env = make_envelope(st.opts.header, p.generation);
  *env.mutable_generation_plan() = plan_common(p, st.opts, start_step, st.checkpoints);
  const auto& wp = env.generation_plan();
  ev::generation_started started{p.generation, p.world_size, p.cause, p.drain, start_step, wp.state_root(), {}};
  for (const auto& n : p.nodes) started.nodes.push_back(n.node_id.str());
  if (!p.promoted.empty()) {
    started.standby_promoted.emplace();
    for (const auto& id : p.promoted) started.standby_promoted->push_back(id.str());
  }
  emit(self, std::move(started));
  st.last_plan = membership_actor_state::sent_plan{env, self->clock().now(), {}};
  // Each node gets its own slice: the plan stays the same size however
  // many nodes there are.
  const auto per_host = ranks_per_host(p);
  for (const auto& n : p.nodes) {
    const auto* member = st.members.find(n.node_id);
    auto mine = env;
    add_ranks_of(*mine.mutable_generation_plan(), n, per_host.at(n.advertise_addr));
    send_to_node(self, member ? member->peer : n.peer, std::move(mine));
    ++st.plans_sent;
  }
  for (const auto& n : p.leaving) {
    send_to_node(self, n.peer, env);
    ++st.plans_sent;
  }
}

void announce(membership_self self, const plan& p) {
  auto& st = self->state;
  auto send_it = [self, p](int64_t start_step) {
    if (!p.adopted) broadcast_plan(self, p, start_step);
  };
  if (!st.job) {
    send_it(st.last_start_step);
    return;
  }
  self->request(st.job, st.opts.liveness.heartbeat_timeout, plan_atom::value, p)
      .then(
          [=](int64_t start_step) {
            if (start_step < 0) return;  // the job is ending: no plan goes out
            self->state.last_start_step = start_step;
            send_it(start_step);
          },
          [=](caf::error& err) {
            // The job actor did not answer: resume from the last step it told
            // us (ranks agree on the committed step among themselves anyway).
            log_line(self->state.opts.log, "job actor did not answer for generation " + std::to_string(p.generation) + " (" +
                                               self->system().render(err) + "); using start step " + std::to_string(self->state.last_start_step));
            send_it(self->state.last_start_step);
          });
}

// The members for the status page, at most twice a second.
void report_members(membership_self self, clock_time now) {
  auto& st = self->state;
  if (!st.opts.events || now - st.last_view < std::chrono::milliseconds(500)) return;
  st.last_view = now;
  ev::members_view v;
  v.generation = current_generation(st);
  const auto& current = st.members.state().current;
  const auto standbys = waiting_standbys(st.members.state(), st.members.options());
  for (const auto& [id, n] : st.members.state().nodes) {
    ev::member_seen m;
    m.node = id.str();
    m.host = n.advertise_addr;
    m.node_rank = n.node_rank;
    m.nproc = n.nproc;
    m.ready_ranks = static_cast<int32_t>(n.ready.size());
    const auto* planned = current ? current->find(id) : nullptr;
    m.in_plan = planned && planned->incarnation == n.incarnation;
    m.standby = standbys.count(id) > 0;
    m.heartbeat_age_s = std::chrono::duration<double>(now - n.last_seen).count();
    v.members.push_back(std::move(m));
  }
  for (const auto& [id, heard] : st.draining) v.draining.push_back(id.str());
  emit(self, std::move(v));
}

ev::loss_cause cause_of(const lost_node& l) {
  if (l.closed) return ev::loss_cause::connection_closed;
  return l.suspected ? ev::loss_cause::suspected_after_collective_failure : ev::loss_cause::heartbeat_timeout;
}

void declare_lost(membership_self self, std::vector<lost_node> lost, clock_time now) {
  auto& st = self->state;
  for (auto& l : lost) {
    auto removed = st.members.remove(l.peer, now);
    if (!removed) continue;
    const std::string why = l.closed ? std::string(l.suspected ? "its connection closed after a collective failure" : "its connection closed")
                                     : std::string(l.suspected ? "silent after a collective failure" : "silent");
    log_line(st.opts.log, "node '" + l.peer.str() + "' lost: " + why + " (last heard " + std::to_string(l.detected_after_s) + " s ago)");
    node_lost(self, l.peer, cause_of(l), l.detected_after_s);
    st.last_loss_silent = !l.closed;
    if (removed.quarantined) quarantined(self, l.peer, removed.reason);
    st.lost.push_back(std::move(l));
  }
}

// Members whose connection closed: lost after the grace, or at once while
// a collective failure is suspected.
void declare_closed_lost(membership_self self, clock_time now) {
  auto& st = self->state;
  declare_lost(self, find_closed(now, st.members.closed(), st.members.last_seen(), judged_liveness(st), st.members.suspecting()), now);
}

// A new generation when the membership calls for one.
void plan_if_due(membership_self self, clock_time now) {
  auto& st = self->state;
  if (st.stopping) return;
  auto d = st.members.decide(now);
  if (d.reason != st.last_reason) {
    log_line(st.opts.log, d.reason);
    st.last_reason = d.reason;
    if (d.below_floor) emit(self, ev::job_waiting{current_generation(st), d.reason});
  }
  if (!d.next) {
    // Plan when the settle window ends, not at the tick after it.
    if (d.settles_at && d.settles_at != st.settle_check) {
      st.settle_check = d.settles_at;
      self->delayed_send(self, *d.settles_at - now, decide_atom::value);
    }
    return;
  }
  const auto& p = st.members.commit(std::move(*d.next));
  if (p.adopted) {
    ++st.adopted;
    st.relays.renumber([&](const node_id& id) {
      const auto* n = st.members.find(id);
      return n ? n->node_rank : -1;
    });
    ev::generation_adopted e;
    e.generation = p.generation;
    e.world_size = p.world_size;
    emit(self, e);
  }
  announce(self, p);
}

// Between ticks, on a closed connection or a collective failure: only the
// closed-connection losses, which need no silence measured (silence is
// judged on ticks, where this process's own stalls are credited).
void on_closed_evidence(membership_self self) {
  auto& st = self->state;
  const auto now = self->clock().now();
  const auto before = st.lost.size();
  declare_closed_lost(self, now);
  if (st.lost.size() != before) plan_if_due(self, now);
}

// Every member lost to silence and no node heard from for orphan_after:
// this coordinator is cut off from the nodes, which cannot reach it
// either (opts.orphaned, once).
void check_orphaned(membership_self self, clock_time now) {
  auto& st = self->state;
  if (!st.opts.orphaned || st.orphaned || st.stopping || !st.last_loss_silent || !st.members.state().nodes.empty()) return;
  if (now - st.heard_any < st.opts.orphan_after) return;
  st.orphaned = true;
  const std::string why = "every node was lost to silence and none has been heard from for " +
                          std::to_string(std::chrono::duration<double>(now - st.heard_any).count()) + " s: this coordinator is cut off from them";
  log_line(st.opts.log, why);
  st.opts.orphaned(why);
}

// Every member's last sign of life, as silence is judged: a member last
// heard through a relay that has itself been silent for two of its
// intervals counts as heard when the relay last was. Its silence says
// nothing while its reporter is silent: it has until the relay's own
// deadline to beat the coordinator (it gives a silent relay up within a
// member interval + relay_first_grace + a tick), and a member that died
// with its relay is lost with it.
std::map<node_id, clock_time> judged_last_seen(membership_actor_state& st, clock_time now) {
  auto seen = st.members.last_seen();
  const auto silent_after = 2 * direct_interval(st);
  for (auto it = st.relayed_by.begin(); it != st.relayed_by.end();) {
    auto m = seen.find(it->first);
    if (m == seen.end()) {
      it = st.relayed_by.erase(it);  // no member any more
      continue;
    }
    if (auto r = seen.find(it->second); r != seen.end() && now - r->second >= silent_after) m->second = std::max(m->second, r->second);
    ++it;
  }
  return seen;
}

void on_tick(membership_self self) {
  auto& st = self->state;
  auto now = self->clock().now();
  // A late tick is this process's stall, not the nodes' silence: their
  // heartbeats wait in the mailbox behind it (pause_tracker).
  if (const auto pause = st.pauses.on_tick(now, st.opts.liveness.heartbeat_interval); pause > clock_duration{0}) {
    st.members.credit_pause(pause, now);
    for (auto& [id, heard] : st.draining) heard = credit_pause(heard, pause, now);
    if (pause >= st.opts.liveness.heartbeat_timeout / 4)
      log_line(st.opts.log, "the coordinator stalled " + std::to_string(std::chrono::duration<double>(pause).count()) +
                                " s (a machine loaded past its cores?); nodes' silence during it is not held against them");
  }
  report_members(self, now);
  declare_lost(self, find_lost(now, judged_last_seen(st, now), judged_liveness(st), st.members.suspecting()), now);
  declare_closed_lost(self, now);
  st.relays.update(st.members.state().nodes.size());
  plan_if_due(self, now);
  check_orphaned(self, now);
}

// A node's message, by kind: membership's own, or the job's (rank status
// after membership has read it). Nothing for the job without a job actor.
void on_node_message(membership_self self, inbound& in) {
  self->state.heard_any = self->clock().now();
  switch (in.env.body_case()) {
    case pb::envelope::kRegisterNode:
      on_register(self, in);
      break;
    case pb::envelope::kHeartbeat:
      on_heartbeat(self, in);
      break;
    case pb::envelope::kLeave:
      on_leave(self, in);
      break;
    case pb::envelope::kRankStatus: {
      const bool suspecting = on_rank_status(self, in);
      // A spare took an exited rank's place: nothing to wait for.
      const bool spare = in.env.rank_status().status() == pb::rank_status::STATE_EXITED && in.env.rank_status().spare_takes_over();
      auto fail = on_checkpoint_refused(self, in);
      if (!self->state.job) {
        ++self->state.dropped;
      } else {
        // The rank's report first: the job journals it before it fails.
        self->send(self->state.job, std::move(in));
        if (fail) self->send(self->state.job, fail_atom::value, *fail);
      }
      // The failure's report reaches the job before the plan it causes.
      if (suspecting) on_closed_evidence(self);
      if (spare) plan_if_due(self, self->clock().now());
      break;
    }
    case pb::envelope::kStepReport:
    case pb::envelope::kEvalReport:
    case pb::envelope::kCheckpointWritten:
    case pb::envelope::kJobError:
      if (self->state.job) {
        self->send(self->state.job, std::move(in));
        break;
      }
      [[fallthrough]];
    default:
      ++self->state.dropped;
      break;
  }
}

// Tells every connected node to shut down (with `checkpoint`: after a final
// one). True when some member node, or a draining node still heard from,
// was told: someone will answer.
bool shut_down_nodes(membership_self self, const std::string& reason, bool checkpoint) {
  auto& st = self->state;
  auto env = make_envelope(st.opts.header, current_generation(st));
  env.mutable_shutdown()->set_reason(reason);
  env.mutable_shutdown()->set_checkpoint(checkpoint);
  for (const auto& [id, peer] : st.peers) send_to_node(self, peer, env);
  if (!st.members.state().nodes.empty()) return true;  // some member node was told
  // Every node left, but one whose ranks still train (it left in the
  // same moment as this stop: Ctrl-C to a shell job reaches all) and
  // that is still heard from stops with the job, its ranks after the
  // final checkpoint.
  const auto now = self->clock().now();
  for (const auto& [id, heard] : st.draining)
    if (now - heard < st.opts.liveness.heartbeat_timeout) return true;
  return false;
}

}  // namespace

std::map<std::string, int32_t> ranks_per_host(const plan& p) {
  std::map<std::string, int32_t> per_host;
  for (const auto& n : p.nodes) per_host[n.advertise_addr] += static_cast<int32_t>(n.local_ranks.size());
  return per_host;
}

void add_ranks_of(pb::generation_plan& out, const plan_node& n, int32_t host_ranks) {
  for (size_t i = 0; i < n.local_ranks.size(); ++i) {
    auto* a = out.add_ranks();
    a->set_node_id(n.node_id.str());
    a->set_local_rank(n.local_ranks[i]);
    a->set_global_rank(n.first_global_rank + static_cast<int32_t>(i));
    a->set_host_ranks(host_ranks);
  }
}

pb::generation_plan to_proto(const plan& p, const coordinator_options& opts, int64_t start_step, const checkpoint_ledger& checkpoints) {
  auto out = plan_common(p, opts, start_step, checkpoints);
  const auto per_host = ranks_per_host(p);
  for (const auto& n : p.nodes) add_ranks_of(out, n, per_host.at(n.advertise_addr));
  return out;
}

pb::generation_plan plan_common(const plan& p, const coordinator_options& opts, int64_t start_step, const checkpoint_ledger& checkpoints) {
  pb::generation_plan out;
  out.set_generation(p.generation);
  out.set_world_size(p.world_size);
  out.set_store_host(opts.store_host);
  out.set_store_port(opts.store_port);
  for (const auto& n : p.nodes) add_node_ranks(out, static_cast<int32_t>(n.local_ranks.size()));
  out.set_start_step(start_step);
  out.set_state_root(p.state_root);
  out.set_checkpoint_store(opts.checkpoint_store);
  out.set_checkpoint_step(-1);
  if (const int64_t ckpt = plan_checkpoint(checkpoints); ckpt >= 0) {
    out.set_fallback_checkpoint_step(ckpt);
    if (p.state_root < 0) {
      out.set_state_root(0);
      out.set_checkpoint_step(ckpt);
    }
  }
  for (int64_t bad : checkpoints.bad) out.add_bad_checkpoint_steps(bad);
  out.set_config_toml(opts.config_toml);
  out.set_drain(p.drain);
  out.set_cause(to_wire(p.cause));
  return out;
}

plan_cause cause_of(const pb::generation_plan& p) { return from_wire(p.cause()); }

plan from_proto(const pb::generation_plan& p) {
  plan out;
  out.generation = p.generation();
  out.world_size = p.world_size();
  out.state_root = p.state_root();
  out.drain = p.drain();
  out.cause = cause_of(p);
  for (const auto& r : p.ranks()) out.ranks.push_back(rank_slot{node_id{r.node_id()}, r.local_rank(), r.global_rank(), 0});
  group_ranks_by_node(out);
  return out;
}

membership_handle::behavior_type membership_actor(membership_self self, coordinator_options opts, outbound out, job_handle job) {
  self->state.members = membership(opts.membership);
  self->state.relays = relay_directory(opts.relays);
  self->state.opts = std::move(opts);
  self->state.out = std::move(out);
  self->state.job = std::move(job);
  self->state.checkpoints = self->state.opts.checkpoints;
  self->send(self, tick_atom::value);
  return {
      [=](inbound& in) { on_node_message(self, in); },
      [=](closed_atom, const std::string& peer) {
        if (!self->state.members.connection_closed(peer, self->clock().now()).empty()) on_closed_evidence(self);
      },
      [=](tick_atom) {
        on_tick(self);
        self->delayed_send(self, self->state.opts.liveness.heartbeat_interval, tick_atom::value);
      },
      [=](decide_atom) {
        self->state.decide_pending = false;
        plan_if_due(self, self->clock().now());
      },
      [=](stop_atom) {
        if (!self->state.stopping) log_line(self->state.opts.log, "stopping: no further generations");
        self->state.stopping = true;
      },
      [=](ckpt_atom, int64_t step, const std::vector<int64_t>& kept) { checkpoint_committed(self->state.checkpoints, step, kept); },
      [=](shutdown_atom, const std::string& reason, bool checkpoint) { return shut_down_nodes(self, reason, checkpoint); },
  };
}

}  // namespace dtactor
