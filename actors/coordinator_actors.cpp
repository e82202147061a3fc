#include "actors/coordinator_actors.hpp"

#include <algorithm>

#include "caf/event_based_actor.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

namespace {

constexpr const char* node_prefix = "node/";

// "node/<id>" -> "<id>"; empty when the sender is not a node.
std::string node_id_of(const std::string& sender) {
  std::string p = node_prefix;
  return sender.compare(0, p.size(), p) == 0 ? sender.substr(p.size()) : std::string{};
}

void log_line(const log_fn& log, const std::string& line) {
  if (log) log(line);
}

using membership_self = caf::stateful_actor<membership_actor_state>*;
using job_self = caf::stateful_actor<job_actor_state>*;

uint64_t current_generation(const membership_actor_state& st) { return st.members.state().current ? st.members.state().current->generation : 0; }

void send_to_node(membership_self self, const std::string& peer, pb::envelope env) { self->state.out(links::nodes, peer, std::move(env)); }

void emit(membership_self self, cluster_event ev) {
  if (self->state.opts.on_event) self->state.opts.on_event(ev);
}

void node_lost(membership_self self, const std::string& id, const std::string& cause, double detected_after_s) {
  auto& st = self->state;
  emit(self, cluster_event{"node_lost", id, cause, detected_after_s, 0, 0, false, {}});
  if (st.job) self->send(st.job, lost_atom::value, id, detected_after_s);
}

void quarantined(membership_self self, const std::string& id, const std::string& reason) {
  log_line(self->state.opts.log, reason);
  emit(self, cluster_event{"node_quarantined", id, {}, 0, 0, 0, false, reason});
}

void on_register(membership_self self, const inbound& in) {
  auto& st = self->state;
  const auto& r = in.env.register_node();
  node_registration reg{
      r.node_id(),         r.advertise_addr(), r.nproc(), in.env.incarnation(), in.peer, {r.ready_ranks().begin(), r.ready_ranks().end()},
      r.last_generation(), std::nullopt};
  if (r.has_current_plan() && r.current_plan().generation() > 0) reg.current_plan = from_proto(r.current_plan());
  auto a = st.members.admit(reg, self->clock().now());
  auto env = make_envelope(st.opts.header, current_generation(st));
  auto* ack = env.mutable_register_ack();
  ack->set_accepted(a.accepted);
  ack->set_reason(a.reason);
  ack->set_node_rank(a.node_rank);
  ack->set_job_id(st.opts.header.job_id);
  if (a.accepted) ack->set_config_toml(st.opts.config_toml);
  if (a.restarted) {
    log_line(st.opts.log, "node '" + r.node_id() + "' restarted (new incarnation); its previous process is lost");
    node_lost(self, r.node_id(), "restarted", a.silent_s);
    if (a.quarantined) quarantined(self, r.node_id(), st.members.state().flaps.at(r.node_id()).reason);
  }
  if (!a.accepted)
    log_line(st.opts.log, "refused node '" + r.node_id() + "': " + a.reason);
  else if (a.joined) {
    log_line(st.opts.log, "node '" + r.node_id() + "' joined as node rank " + std::to_string(a.node_rank) + " (nproc " + std::to_string(r.nproc()) +
                              (a.rejoined ? ", its previous rank)" : ")"));
    emit(self, cluster_event{"node_joined", r.node_id(), {}, 0, 0, 0, false, {}});
  }
  send_to_node(self, in.peer, std::move(env));
}

void on_heartbeat(membership_self self, const inbound& in) {
  auto& st = self->state;
  auto id = node_id_of(in.env.sender());
  auto env = make_envelope(st.opts.header, current_generation(st));
  if (st.members.touch(id, in.env.incarnation(), self->clock().now(), in.peer)) {
    auto* ack = env.mutable_heartbeat_ack();
    ack->set_seq(in.env.heartbeat().seq());
    ack->set_echoed_sent_unix(in.env.heartbeat().sent_unix());
  } else {
    ++st.refused_heartbeats;
    auto* ack = env.mutable_register_ack();
    ack->set_accepted(false);
    ack->set_node_rank(-1);
    ack->set_job_id(st.opts.header.job_id);
    ack->set_reason("node '" + id + "' is not a member (declared lost, restarted, or the coordinator restarted); register again");
  }
  send_to_node(self, in.peer, std::move(env));
}

void on_leave(membership_self self, const inbound& in) {
  auto& st = self->state;
  auto id = node_id_of(in.env.sender());
  const auto* n = st.members.find(id);
  if (!n || n->incarnation != in.env.incarnation()) return;
  st.members.remove(id, self->clock().now(), departure::left);
  log_line(st.opts.log, "node '" + id + "' left: " + in.env.leave().reason());
  emit(self, cluster_event{"node_left", id, {}, 0, 0, 0, false, in.env.leave().reason()});
}

// Readiness and failures of a node's ranks. The node agent relays them as
// "node/<id>" (its incarnation) or passes a rank's own envelope on as
// "rank/<id>/<local_rank>" (the rank's incarnation: the node's is assumed).
void on_rank_status(membership_self self, const inbound& in) {
  auto& st = self->state;
  const auto& s = in.env.rank_status();
  auto id = node_id_of(in.env.sender());
  uint64_t incarnation = in.env.incarnation();
  const std::string rank_prefix = "rank/";
  if (id.empty() && in.env.sender().compare(0, rank_prefix.size(), rank_prefix) == 0) {
    auto rest = in.env.sender().substr(rank_prefix.size());
    id = rest.substr(0, rest.rfind('/'));
    if (const auto* n = st.members.find(id)) incarnation = n->incarnation;
  }
  if (id.empty()) return;
  auto now = self->clock().now();
  switch (s.status()) {
    case pb::rank_status::STATE_IDLE:
    case pb::rank_status::STATE_READY:
      st.members.set_rank_ready(id, incarnation, s.local_rank(), true, now);
      break;
    case pb::rank_status::STATE_EXITED:
      if (st.members.set_rank_ready(id, incarnation, s.local_rank(), false, now))
        log_line(st.opts.log, "rank " + std::to_string(s.local_rank()) + " of node '" + id + "' exited (code " + std::to_string(s.exit_code()) + ")");
      break;
    case pb::rank_status::STATE_FAILED:
      if (st.members.report_failure(in.env.generation(), id, s.local_rank(), now))
        log_line(st.opts.log, "rank " + std::to_string(s.local_rank()) + " of node '" + id + "' failed in generation " +
                                  std::to_string(in.env.generation()) + " (" + s.detail() + "); suspecting silent nodes");
      break;
    default:
      break;
  }
}

void broadcast_plan(membership_self self, const plan& p, int64_t start_step) {
  auto& st = self->state;
  // A newer generation was planned while we waited for the start step.
  if (current_generation(st) != p.generation) return;
  auto env = make_envelope(st.opts.header, p.generation);
  *env.mutable_generation_plan() = to_proto(p, st.opts, start_step);
  for (const auto& n : p.nodes) {
    const auto* member = st.members.find(n.node_id);
    send_to_node(self, member ? member->peer : n.peer, env);
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

void on_tick(membership_self self) {
  auto& st = self->state;
  auto now = self->clock().now();
  for (auto& l : find_lost(now, st.members.last_seen(), st.opts.liveness, st.members.suspecting())) {
    auto removed = st.members.remove(l.peer, now);
    log_line(st.opts.log, "node '" + l.peer + "' lost: silent for " + std::to_string(l.detected_after_s) + " s" +
                              (l.suspected ? " after a collective failure" : ""));
    node_lost(self, l.peer, l.suspected ? "suspected_after_collective_failure" : "heartbeat_timeout", l.detected_after_s);
    if (removed.quarantined) quarantined(self, l.peer, removed.reason);
    st.lost.push_back(std::move(l));
  }
  if (st.stopping) return;
  auto d = st.members.decide(now);
  if (d.reason != st.last_reason) {
    log_line(st.opts.log, d.reason);
    st.last_reason = d.reason;
    if (d.below_floor) emit(self, cluster_event{"job_waiting", {}, {}, 0, current_generation(st), 0, false, d.reason});
  }
  if (!d.next) return;
  const auto& p = st.members.commit(std::move(*d.next));
  if (p.adopted) {
    ++st.adopted;
    emit(self, cluster_event{"generation_adopted", {}, p.cause, 0, p.generation, p.world_size, p.drain, {}});
  } else {
    emit(self, cluster_event{"generation_planned", {}, p.cause, 0, p.generation, p.world_size, p.drain, {}});
  }
  announce(self, p);
}

}  // namespace

pb::generation_plan to_proto(const plan& p, const coordinator_options& opts, int64_t start_step) {
  pb::generation_plan out;
  out.set_generation(p.generation);
  out.set_world_size(p.world_size);
  out.set_store_host(opts.store_host);
  out.set_store_port(opts.store_port);
  std::map<std::string, int32_t> per_host;  // advertise address -> ranks there
  for (const auto& n : p.nodes) per_host[n.advertise_addr] += static_cast<int32_t>(n.local_ranks.size());
  for (const auto& r : p.ranks) {
    auto* a = out.add_ranks();
    a->set_node_id(r.node_id);
    a->set_local_rank(r.local_rank);
    a->set_global_rank(r.global_rank);
    const auto* n = p.find(r.node_id);
    a->set_host_ranks(n ? per_host[n->advertise_addr] : 0);
  }
  out.set_start_step(start_step);
  out.set_state_root(p.state_root);
  if (p.state_root < 0 && opts.newest_checkpoint) {
    auto [step, blob] = opts.newest_checkpoint();
    if (step >= 0 && !blob.empty()) {
      out.set_state_root(0);
      out.set_checkpoint(std::move(blob));
    }
  }
  out.set_config_toml(opts.config_toml);
  out.set_drain(p.drain);
  out.set_cause(p.cause);
  return out;
}

plan from_proto(const pb::generation_plan& p) {
  plan out;
  out.generation = p.generation();
  out.world_size = p.world_size();
  out.state_root = p.state_root();
  out.drain = p.drain();
  out.cause = p.cause();
  std::vector<const pb::rank_assignment*> order;
  for (const auto& r : p.ranks()) order.push_back(&r);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) { return a->global_rank() < b->global_rank(); });
  for (const auto* r : order) {
    out.ranks.push_back(rank_slot{r->node_id(), r->local_rank(), r->global_rank(), 0});
    if (out.nodes.empty() || out.nodes.back().node_id != r->node_id()) {
      plan_node n;
      n.node_id = r->node_id();
      n.first_global_rank = r->global_rank();
      out.nodes.push_back(std::move(n));
    }
    out.nodes.back().local_ranks.push_back(r->local_rank());
    out.nodes.back().nproc = static_cast<int32_t>(out.nodes.back().local_ranks.size());
  }
  return out;
}

caf::behavior membership_actor(membership_self self, coordinator_options opts, outbound out, caf::actor job) {
  self->state.members = membership(opts.membership);
  self->state.opts = std::move(opts);
  self->state.out = std::move(out);
  self->state.job = std::move(job);
  self->send(self, tick_atom::value);
  return {
      [=](inbound& in) {
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
          case pb::envelope::kRankStatus:
            on_rank_status(self, in);
            [[fallthrough]];
          case pb::envelope::kStepReport:
          case pb::envelope::kEvalReport:
          case pb::envelope::kCheckpointData:
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
      },
      [=](tick_atom) {
        on_tick(self);
        self->delayed_send(self, self->state.opts.liveness.heartbeat_interval, tick_atom::value);
      },
      [=](stop_atom) {
        if (!self->state.stopping) log_line(self->state.opts.log, "stopping: no further generations");
        self->state.stopping = true;
      },
  };
}

// -- job actor ----------------------------------------------------------------

namespace {

void finish(job_self self, const std::string& reason) {
  auto& st = self->state;
  if (st.finished) return;
  st.finished = true;
  st.finish_reason = reason;
  log_line(st.opts.log, std::string(st.stopping ? "job stopped" : "job finished") + " at step " + std::to_string(st.committed_step) + ": " + reason);
  auto env = make_envelope(st.opts.header, st.generation);
  env.mutable_shutdown()->set_reason(reason);
  for (const auto& n : st.nodes) st.out(links::nodes, n.peer, env);
  if (st.opts.on_finished) st.opts.on_finished(st.committed_step, reason);
}

void check_finished(job_self self) {
  auto& st = self->state;
  if (st.world_size <= 0) return;
  // Reaching max_steps is not enough: rank 0 still evaluates and sends the
  // final checkpoint after its last step report. The job ends once every
  // rank has said FINISHED (sent after those), so nothing is cut off.
  if (static_cast<int32_t>(st.finished_ranks.size()) < st.world_size) return;
  if (st.committed_step >= st.opts.max_steps)
    finish(self, "reached train.max_steps = " + std::to_string(st.opts.max_steps));
  else if (st.stopping)
    finish(self, "every rank of generation " + std::to_string(st.generation) + " stopped after the final checkpoint");
  else
    finish(self, "every rank of generation " + std::to_string(st.generation) + " reported finished");
}

void record_step(job_self self, int32_t global_rank, int64_t step) {
  auto& st = self->state;
  if (global_rank < 0 || global_rank >= st.world_size) return;
  auto& s = st.rank_steps[global_rank];
  s = std::max(s, step);
  if (static_cast<int32_t>(st.rank_steps.size()) < st.world_size) return;
  int64_t low = st.rank_steps.begin()->second;
  for (const auto& [r, v] : st.rank_steps) low = std::min(low, v);
  st.committed_step = std::max(st.committed_step, low);
}

}  // namespace

caf::behavior job_actor(job_self self, job_options opts, outbound out) {
  self->state.committed_step = opts.initial_step;
  self->state.opts = std::move(opts);
  self->state.out = std::move(out);
  return {
      [=](plan_atom, const plan& p) -> int64_t {
        auto& st = self->state;
        if (p.generation > st.generation) {
          st.generation = p.generation;
          st.world_size = p.world_size;
          st.nodes = p.nodes;
          st.rank_steps.clear();
          st.finished_ranks.clear();
        }
        return st.committed_step;
      },
      [=](inbound& in) {
        auto& st = self->state;
        if (in.env.generation() != st.generation || st.finished) {
          ++st.stale_reports;
          return;
        }
        if (in.env.has_step_report()) {
          record_step(self, in.env.step_report().global_rank(), in.env.step_report().step());
        } else if (in.env.has_rank_status()) {
          const auto& s = in.env.rank_status();
          if (s.status() == pb::rank_status::STATE_FINISHED) {
            record_step(self, s.global_rank(), s.step());
            st.finished_ranks.insert(s.global_rank());
          }
        }
        check_finished(self);
      },
      [=](stop_atom) { self->state.stopping = true; },
      [=](lost_atom, const std::string& node_id, double detected_after_s) {
        ++self->state.nodes_lost;
        log_line(self->state.opts.log, "job: node '" + node_id + "' lost after " + std::to_string(detected_after_s) + " s of silence");
      },
  };
}

}  // namespace dtactor
