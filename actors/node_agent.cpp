#include "actors/node_agent.hpp"
#include "actors/node_agent_detail.hpp"

#include <algorithm>

#include "base/printable.hpp"
#include "caf/stateful_actor.hpp"

namespace dtactor {

std::chrono::milliseconds backoff_delay(std::chrono::milliseconds initial, std::chrono::milliseconds max, uint32_t attempt) {
  auto d = initial;
  for (uint32_t i = 0; i < attempt && d < max; ++i) d *= 2;
  return std::min(d, max);
}

const char* to_string(node_phase p) {
  switch (p) {
    case node_phase::unregistered:
      return "unregistered";
    case node_phase::registering:
      return "registering";
    case node_phase::registered:
      return "registered";
    case node_phase::running:
      return "running";
    case node_phase::leaving:
      return "leaving";
    case node_phase::stopped:
      return "stopped";
  }
  return "?";
}

// Shared with actors/node_agent_relay.cpp (node_agent_detail.hpp).
namespace node_agent_detail {

void log_line(agent_self self, const std::string& line) {
  if (self->state.opts.log) self->state.opts.log(line);
}

bool member(const node_agent_state& st) { return st.phase == node_phase::registered || st.phase == node_phase::running; }
// Rank reports still go up while the node leaves: its ranks finish their step.
bool relaying(const node_agent_state& st) { return member(st) || st.phase == node_phase::leaving; }
bool winding_down(const node_agent_state& st) { return st.phase == node_phase::leaving || st.phase == node_phase::stopped; }
uint64_t generation(const node_agent_state& st) { return st.plan ? st.plan->generation() : 0; }

pb::envelope envelope(agent_self self) { return make_envelope(self->state.opts.header, generation(self->state)); }

void to_coordinator(agent_self self, pb::envelope env) { self->state.out(links::coordinator, "", std::move(env)); }

int32_t global_rank_of(const node_agent_state& st, int32_t local_rank) {
  if (!st.plan) return -1;
  for (const auto& a : st.plan->ranks())
    if (a.node_id() == st.opts.node_id.str() && a.local_rank() == local_rank) return a.global_rank();
  return -1;
}

void send_register(agent_self self) {
  auto& st = self->state;
  auto env = envelope(self);
  auto* r = env.mutable_register_node();
  r->set_node_id(st.opts.node_id.str());
  r->set_advertise_addr(st.opts.advertise_addr);
  r->set_nproc(st.opts.nproc);
  r->set_hostname(st.opts.hostname);
  r->set_metrics_port(st.opts.metrics_port);
  r->set_last_step(st.last_step);
  r->set_last_generation(generation(st));
  r->set_standby(st.opts.standby);
  r->set_relay_endpoint(st.opts.relay_endpoint);
  // After a coordinator restart the new one can adopt the running generation.
  if (st.plan) *r->mutable_current_plan() = *st.plan;
  for (int32_t l = 0; l < static_cast<int32_t>(st.ranks.size()); ++l)
    if (st.ranks[l].alive && st.ranks[l].ready) r->add_ready_ranks(l);
  ++st.registers_sent;
  to_coordinator(self, std::move(env));
}

// A registering node sends nothing but registers, and the coordinator
// counts a peer silent for heartbeat_timeout as lost: retries stay a third
// of the timeout apart at most (the job's timeout once register_ack said
// it), so that one lost or late register never costs the membership.
std::chrono::milliseconds register_backoff_cap(const node_agent_options& o) {
  return std::min(o.register_backoff_max, std::max(o.liveness.heartbeat_timeout / 3, std::chrono::milliseconds(1)));
}

void schedule_register_retry(agent_self self) {
  auto& st = self->state;
  auto delay = backoff_delay(st.opts.register_backoff_initial, register_backoff_cap(st.opts), st.register_attempt);
  self->delayed_send(self, delay, retry_atom::value, st.register_epoch);
}

void enter_registering(agent_self self, const std::string& why) {
  auto& st = self->state;
  if (st.phase != node_phase::unregistered) log_line(self, "node '" + st.opts.node_id.str() + "' registers again: " + why);
  st.phase = node_phase::registering;
  ++st.register_epoch;
  st.register_attempt = 0;
  drop_relay(self);
  send_register(self);
  schedule_register_retry(self);
}

void report_rank(agent_self self, int32_t local_rank, pb::rank_status::state state, int32_t exit_code, const std::string& detail,
                 bool spare_takes_over = false) {
  auto& st = self->state;
  if (!relaying(st)) return;
  auto env = envelope(self);
  auto* s = env.mutable_rank_status();
  s->set_global_rank(global_rank_of(st, local_rank));
  s->set_local_rank(local_rank);
  s->set_status(state);
  s->set_exit_code(exit_code);
  s->set_detail(detail);
  s->set_step(st.last_step);
  s->set_spare_takes_over(spare_takes_over);
  to_coordinator(self, std::move(env));
}

void schedule_restart(agent_self self, int32_t local_rank) {
  auto& r = self->state.ranks[local_rank];
  auto delay = backoff_delay(self->state.opts.restart_backoff_initial, self->state.opts.restart_backoff_max, r.failures > 0 ? r.failures - 1 : 0);
  r.restart_pending = true;
  self->delayed_send(self, delay, restart_atom::value, local_rank, ++r.restart_epoch);
}

void start_rank(agent_self self, int32_t local_rank) {
  auto& st = self->state;
  auto& r = st.ranks[local_rank];
  r.restart_pending = false;
  auto pid = st.launcher->spawn(local_rank);
  if (pid.ok()) {
    r.pid = *pid;
    r.alive = true;
    r.ready = false;
    r.peer.clear();
    ++r.starts;
    return;
  }
  ++r.failures;
  log_line(self, "could not start rank " + std::to_string(local_rank) + ": " + pid.message());
  report_rank(self, local_rank, pb::rank_status::STATE_FAILED, -1, "could not start: " + pid.message());
  schedule_restart(self, local_rank);
}

void start_missing_ranks(agent_self self) {
  auto& st = self->state;
  for (int32_t l = 0; l < static_cast<int32_t>(st.ranks.size()); ++l)
    if (!st.ranks[l].alive && !st.ranks[l].restart_pending && !st.ranks[l].given_up) start_rank(self, l);
}

void send_plan_to_rank(agent_self self, const rank_process& r) {
  auto& st = self->state;
  if (!st.plan || r.peer.empty()) return;
  auto env = envelope(self);
  *env.mutable_generation_plan() = *st.plan;
  st.out(links::ranks, r.peer, std::move(env));
}

// Generation 0 carries the job's config (and where to fetch a shipped module
// file): the rank loads its model and data, then reports STATE_IDLE.
void send_warm_up(agent_self self, const std::string& peer) {
  auto& st = self->state;
  if (st.config_toml.empty() || peer.empty()) return;
  auto env = make_envelope(st.opts.header, 0);
  env.set_job_id(st.job_id);
  env.mutable_generation_plan()->set_generation(0);
  env.mutable_generation_plan()->set_config_toml(st.config_toml);
  env.mutable_generation_plan()->set_checkpoint_store(st.checkpoint_store);
  env.mutable_generation_plan()->set_module_object(st.module_object);
  env.mutable_generation_plan()->set_module_digest(st.module_digest);
  st.out(links::ranks, peer, std::move(env));
}

void stop_rank(agent_self self, rank_process& r) {
  if (r.alive) self->state.launcher->terminate(r.pid);
}

void wind_down(agent_self self, node_phase phase, const std::string& reason, bool stop_ranks = true) {
  auto& st = self->state;
  st.phase = phase;
  for (auto& r : st.ranks) {
    r.restart_pending = false;
    ++r.restart_epoch;  // cancels pending restarts
    if (!r.alive || !stop_ranks) continue;
    if (phase == node_phase::stopped && !r.peer.empty()) {
      auto env = envelope(self);
      env.mutable_shutdown()->set_reason(reason);
      st.out(links::ranks, r.peer, std::move(env));
    } else {
      st.launcher->terminate(r.pid);
    }
  }
  // Spares are no part of a drain or a stop.
  for (const auto& p : st.spares.processes()) st.launcher->terminate(p.pid);
  // Ranks told to end exit within the grace, or are terminated then.
  if (phase == node_phase::stopped && stop_ranks) self->delayed_send(self, st.opts.shutdown_grace, stop_due_atom::value);
}

void emit(agent_self self, node_event e) {
  if (self->state.opts.events) self->state.opts.events(e);
}

void quit_if_done(agent_self self) {
  auto& st = self->state;
  if (!winding_down(st)) return;
  for (const auto& r : st.ranks)
    if (r.alive) return;
  if (!st.spares.processes().empty()) return;
  self->quit();
}

// ---- warm spares (actors/spare_pool.hpp) ----

std::string exit_code_hint(int32_t code);

int32_t spares_wanted(const node_agent_state& st) {
  if (st.opts.spares) return *st.opts.spares;
  if (!st.opts.spares_from_config) return 0;
  return st.opts.spares_from_config(st.config_toml).value_or(0);
}

void note_spares(agent_self self, int32_t taken) {
  std::vector<int32_t> pids;
  for (const auto& p : self->state.spares.processes()) pids.push_back(p.pid);
  emit(self, nev::spares{self->state.spares.warm(), taken, std::move(pids)});
}

// Starts the spares the pool wants now.
void start_spares(agent_self self, clock_time now) {
  auto& st = self->state;
  for (int32_t n = st.spares.due(now); n > 0; --n) {
    auto pid = st.launcher->spawn_spare();
    if (!pid.ok()) {
      log_line(self, "could not start a spare rank process: " + pid.message());
      st.spares.start_failed(now);
      return;
    }
    st.spares.started(*pid, now);
    note_spares(self, 0);
  }
}

// A spare this node started says hello (with no local rank): it gets the
// warm-up, or is stopped when the node winds down. False: not a spare.
bool on_spare_hello(agent_self self, const inbound& in) {
  auto& st = self->state;
  const auto& hello = in.env.rank_hello();
  auto* sp = hello.local_rank() < 0 ? st.spares.by_pid(hello.pid()) : nullptr;
  if (!sp) return false;
  sp->peer = in.peer;
  sp->last_seen = self->clock().now();
  if (winding_down(st))
    st.launcher->terminate(sp->pid);
  else
    send_warm_up(self, sp->peer);
  return true;
}

// What a waiting spare says (heartbeats, the end of its warm-up) stays on
// this node: it is no rank of the job yet. False: not from a spare.
bool on_spare_message(agent_self self, const inbound& in) {
  auto& st = self->state;
  auto* sp = st.spares.by_peer(in.peer);
  if (!sp) return false;
  sp->last_seen = self->clock().now();
  if (!in.env.has_rank_status()) return true;
  const auto& s = in.env.rank_status();
  if (s.status() == pb::rank_status::STATE_IDLE && !sp->warm) {
    st.spares.warmed(*sp);
    log_line(self, "spare rank process (pid " + std::to_string(sp->pid) + ") warmed up: waiting to take a rank's place");
    note_spares(self, 0);
  } else if (s.status() == pb::rank_status::STATE_FAILED) {
    log_line(self, "spare rank process (pid " + std::to_string(sp->pid) + ") failed: " + s.detail() + "; stopping it");
    st.launcher->terminate(sp->pid);
  }
  return true;
}

// The slot of an exited rank goes to the oldest warm spare, told so before
// any plan reaches it; the pool starts its place again later. The spare's
// pid, or none when no spare is warm.
std::optional<int32_t> hand_slot_to_spare(agent_self self, int32_t local_rank) {
  auto& st = self->state;
  const auto now = self->clock().now();
  auto spare = st.spares.take(now);
  if (!spare) return std::nullopt;
  auto& r = st.ranks[local_rank];
  r.pid = spare->pid;
  r.alive = true;
  r.ready = true;  // warmed up: the coordinator plans it in at once (spare_takes_over)
  r.peer = spare->peer;
  r.last_seen = now;
  r.finished.reset();
  ++r.starts;
  auto env = envelope(self);
  env.mutable_spare_slot()->set_local_rank(local_rank);
  st.out(links::ranks, r.peer, std::move(env));
  emit(self, nev::rank_started{local_rank, r.pid, r.peer});
  note_spares(self, 1);
  return r.pid;
}

// A waiting spare ended (killed, crashed, stopped with the node): another
// starts after the pool's backoff.
void on_spare_exit(agent_self self, int32_t pid, int32_t exit_code) {
  auto& st = self->state;
  if (!st.spares.exited(pid, self->clock().now())) return;
  if (!winding_down(st))
    log_line(self, "spare rank process (pid " + std::to_string(pid) + ") exited with code " + std::to_string(exit_code) + exit_code_hint(exit_code) +
                       "; starting another");
  note_spares(self, 0);
  quit_if_done(self);
}

// The coordinator accepted this node (or refused it: logged once per
// reason; a member goes back to registering).
void on_register_ack(agent_self self, const pb::register_ack& ack) {
  auto& st = self->state;
  if (!ack.accepted()) {
    // Once per reason, not once per retry.
    if (ack.reason() != st.last_refusal) log_line(self, "registration refused: " + printable(ack.reason()));
    st.last_refusal = ack.reason();
    if (member(st)) enter_registering(self, ack.reason());
    // While registering, the retry timer keeps trying.
    return;
  }
  if (st.phase != node_phase::registering) return;  // duplicate ack of a retried register
  st.phase = node_phase::registered;
  st.node_rank = ack.node_rank();
  st.job_id = ack.job_id();
  st.config_toml = ack.config_toml();
  st.checkpoint_store = ack.checkpoint_store();
  st.module_object = ack.module_object();
  st.module_digest = ack.module_digest();
  st.heartbeat_every = std::chrono::milliseconds(ack.heartbeat_interval_ms());
  take_relay(self, ack.relay());
  if (st.opts.liveness_from_config)
    if (auto l = st.opts.liveness_from_config(st.config_toml)) st.opts.liveness = *l;
  if (st.opts.rank_exit_limit_from_config)
    if (auto l = st.opts.rank_exit_limit_from_config(st.config_toml)) st.opts.rank_exit_limit = *l;
  st.spares.resize(spares_wanted(st), self->clock().now());
  ++st.register_epoch;  // cancels the pending retry
  log_line(self, "node '" + st.opts.node_id.str() + "' registered as node rank " + std::to_string(st.node_rank));
  emit(self, nev::registered{st.job_id, st.node_rank});
  start_missing_ranks(self);
  for (const auto& r : st.ranks)
    if (r.alive && r.finished) to_coordinator(self, *r.finished);
}

// A newer plan goes to every rank; fenced: an older or equal one is dropped.
void on_generation_plan(agent_self self, const pb::generation_plan& plan) {
  auto& st = self->state;
  if (st.phase == node_phase::stopped || st.phase == node_phase::unregistered) return;
  if (st.plan && plan.generation() <= st.plan->generation()) return;  // fenced: not newer
  st.plan = plan;
  emit(self, nev::plan_received{st.plan->generation(), st.plan->world_size()});
  if (st.phase == node_phase::leaving) {
    // The drain plan without us: ranks finish their step, report IDLE
    // and are stopped then.
    for (const auto& r : st.ranks) send_plan_to_rank(self, r);
    return;
  }
  if (st.phase == node_phase::registering) ++st.register_epoch;  // a plan naming us implies we are a member
  st.phase = node_phase::running;
  for (const auto& r : st.ranks) send_plan_to_rank(self, r);
}

// A checkpointed stop is relayed to the ranks (they stop at an agreed
// step); any other shutdown stops this node.
void on_shutdown(agent_self self, const pb::shutdown& shutdown) {
  auto& st = self->state;
  if (shutdown.checkpoint()) {
    // Ranks stop at an agreed step after rank 0's final checkpoint; the
    // coordinator sends the final shutdown afterwards.
    log_line(self, "stopping at the next step boundary: " + shutdown.reason());
    if (!st.job_stopping && st.phase == node_phase::leaving) {
      // This node's own signal arrived with the coordinator's: part of
      // the stop, not a preemption. The ranks stop with the job.
      log_line(self, "the coordinator is stopping the job: the ranks stop with it");
      self->delayed_send(self, st.opts.stop_timeout, stop_due_atom::value);
    }
    st.job_stopping = true;
    for (const auto& r : st.ranks)
      if (r.alive && !r.peer.empty()) {
        auto out = envelope(self);
        *out.mutable_shutdown() = shutdown;
        st.out(links::ranks, r.peer, std::move(out));
      }
    return;
  }
  if (st.phase == node_phase::stopped) return;  // the coordinator may say it twice
  log_line(self, "shutdown: " + shutdown.reason());
  if (shutdown.refused()) emit(self, nev::refused{shutdown.reason()});
  wind_down(self, node_phase::stopped, shutdown.reason());
  quit_if_done(self);
}

void on_coordinator(agent_self self, const inbound& in) {
  self->state.last_heard = self->clock().now();
  const auto& env = in.env;
  switch (env.body_case()) {
    case pb::envelope::kRegisterAck:
      on_register_ack(self, env.register_ack());
      break;
    case pb::envelope::kHeartbeatAck:
      on_coordinator_ack(self, env.heartbeat_ack());
      emit(self, nev::heartbeat_acked{env.heartbeat_ack().echoed_sent_steady_s()});
      break;
    case pb::envelope::kGenerationPlan:
      on_generation_plan(self, env.generation_plan());
      break;
    case pb::envelope::kShutdown:
      on_shutdown(self, env.shutdown());
      break;
    default:
      break;
  }
}

// A process this node started says hello: its peer is known now; it gets
// the warm-up (and the plan, if one names it already), or is stopped when
// the node winds down. A hello from another process is ignored.
void on_rank_hello(agent_self self, const inbound& in) {
  auto& st = self->state;
  if (on_spare_hello(self, in)) return;
  const auto& hello = in.env.rank_hello();
  auto l = hello.local_rank();
  if (l < 0 || l >= static_cast<int32_t>(st.ranks.size())) return;
  auto& r = st.ranks[l];
  if (!r.alive || r.pid != hello.pid()) return;  // not the process we started
  r.peer = in.peer;
  r.last_seen = self->clock().now();
  emit(self, nev::rank_started{l, r.pid, r.peer});
  if (winding_down(st)) {
    stop_rank(self, r);
  } else {
    send_warm_up(self, r.peer);
    // A plan that already names this rank's first process (planned
    // before it said hello) goes along; a restarted process is not part
    // of the running generation and waits for the next one.
    if (r.starts == 1 && global_rank_of(st, l) >= 0) send_plan_to_rank(self, r);
  }
}

// What a rank's status tells this node about the rank (ready, finished,
// idle while leaving: stopped); the status itself is relayed by the caller.
void note_rank_status(agent_self self, const inbound& in) {
  auto& st = self->state;
  const auto& s = in.env.rank_status();
  if (s.local_rank() < 0 || s.local_rank() >= static_cast<int32_t>(st.ranks.size())) return;
  auto& r = st.ranks[s.local_rank()];
  if (r.peer != in.peer) return;
  r.last_seen = self->clock().now();
  if (s.status() == pb::rank_status::STATE_READY) r.failures = 0;
  if (s.status() == pb::rank_status::STATE_READY || s.status() == pb::rank_status::STATE_IDLE) r.ready = true;
  if (s.status() == pb::rank_status::STATE_FINISHED) r.finished = in.env;
  if (s.status() == pb::rank_status::STATE_READY) r.finished.reset();
  // A leaving node's rank that finished its last step.
  if (st.phase == node_phase::leaving && s.status() == pb::rank_status::STATE_IDLE) stop_rank(self, r);
}

void on_rank(agent_self self, inbound& in) {
  auto& st = self->state;
  auto& env = in.env;
  if (env.body_case() != pb::envelope::kRankHello && on_spare_message(self, in)) return;
  switch (env.body_case()) {
    case pb::envelope::kRankHello:
      on_rank_hello(self, in);
      return;
    case pb::envelope::kHeartbeat: {
      for (auto& r : st.ranks)
        if (r.alive && r.peer == in.peer) r.last_seen = self->clock().now();
      return;
    }
    case pb::envelope::kStepReport:
      st.last_step = std::max(st.last_step, env.step_report().step());
      if (env.step_report().step() > st.best_step) {
        st.best_step = env.step_report().step();
        st.exits_without_step = 0;
      }
      st.spares.training(self->clock().now());  // a recovery is over: missing spares may start
      if (st.opts.annotate_report) st.opts.annotate_report(in.peer, *env.mutable_step_report());
      emit(self, nev::steps_reported{env.step_report()});
      break;
    case pb::envelope::kRankStatus:
      note_rank_status(self, in);
      break;
    case pb::envelope::kEvalReport:
    case pb::envelope::kCheckpointWritten:
    case pb::envelope::kJobError:
      break;
    default:
      return;
  }
  if (relaying(st)) to_coordinator(self, std::move(env));
}

// A rank process that stopped heartbeating (hung, or stopped) is killed;
// its exit is reported and it is restarted like a crashed one.
void check_ranks(agent_self self, clock_time now) {
  auto& st = self->state;
  std::map<std::string, clock_time> seen;
  for (const auto& r : st.ranks)
    if (r.alive && !r.peer.empty()) seen[std::to_string(r.pid)] = r.last_seen;
  for (const auto& p : st.spares.processes())
    if (!p.peer.empty()) seen[std::to_string(p.pid)] = p.last_seen;
  // Lenient: a falsely killed rank costs a recovery, and a rank's control
  // thread competes with training for the cores.
  auto lenient = st.opts.liveness;
  lenient.heartbeat_timeout *= 5;
  for (const auto& lost : find_lost(now, seen, lenient)) {
    for (auto& r : st.ranks)
      if (r.alive && std::to_string(r.pid) == lost.peer) {
        log_line(self, "rank with pid " + lost.peer + " silent for " + std::to_string(lost.detected_after_s) + " s; killing it");
        r.last_seen = now;  // killed once; its exit follows
        st.launcher->kill(r.pid);
      }
    for (const auto& p : st.spares.processes())
      if (std::to_string(p.pid) == lost.peer) {
        log_line(self, "spare rank process with pid " + lost.peer + " silent; killing it");
        st.spares.by_pid(p.pid)->last_seen = now;
        st.launcher->kill(p.pid);
        break;
      }
  }
}

// Ticks come every configured interval; a beat goes on the tick nearest to
// a whole asked-for interval after the last one.
bool beat_due(const node_agent_state& st, clock_time now) {
  return st.heartbeat_seq == 0 || now - st.last_beat + st.opts.liveness.heartbeat_interval / 2 >= beat_interval(st);
}

void on_tick(agent_self self) {
  auto& st = self->state;
  auto now = self->clock().now();
  // A late tick is this process's stall: what arrived meanwhile waits in
  // the mailbox behind it (pause_tracker).
  if (const auto pause = st.pauses.on_tick(now, st.opts.liveness.heartbeat_interval); pause > clock_duration{0}) {
    st.last_heard = credit_pause(st.last_heard, pause, now);
    for (auto& r : st.ranks) r.last_seen = credit_pause(r.last_seen, pause, now);
    st.spares.credit_pause(pause, now);
  }
  if (!winding_down(st)) check_ranks(self, now);
  if (!winding_down(st) && !st.config_toml.empty()) start_spares(self, now);
  if (!member(st)) return;
  if (!find_lost(now, {{"coordinator", st.last_heard}}, st.opts.liveness).empty()) {
    enter_registering(self, "no word from the coordinator for " + std::to_string(std::chrono::duration<double>(now - st.last_heard).count()) + " s");
    return;
  }
  if (!given_up_relay(self, now) && !beat_due(st, now)) return;
  send_heartbeat(self, now);
  // A finished rank's FINISHED is said again about once a second until the
  // job ends: one sent while no coordinator listened (a takeover by a
  // standby) or before a new coordinator adopted the generation would
  // otherwise be lost, and the job would never end.
  const auto every = std::max<int64_t>(1, std::chrono::seconds(1) / beat_interval(st));
  if (st.heartbeat_seq % static_cast<uint64_t>(every) == 0)
    for (const auto& r : st.ranks)
      if (r.alive && r.finished) to_coordinator(self, *r.finished);
}

void leave(agent_self self, const std::string& reason, const pb::preemption_notice* notice);

// What an exit code says about how the process ended, for a log line.
std::string exit_code_hint(int32_t code) {
  if (code == 128 + 9) return " (SIGKILL: the kernel's out-of-memory killer, unless someone sent it; see dmesg)";
  if (code == 128 + 6) return " (SIGABRT)";
  if (code == 128 + 11) return " (SIGSEGV)";
  if (code > 128 && code < 128 + 65) return " (signal " + std::to_string(code - 128) + ")";
  return "";
}

void on_rank_exit(agent_self self, int32_t pid, int32_t exit_code) {
  auto& st = self->state;
  // The rank whose running process this was; none for an older process.
  int32_t local_rank = -1;
  for (size_t l = 0; l < st.ranks.size(); ++l)
    if (st.ranks[l].alive && st.ranks[l].pid == pid) local_rank = static_cast<int32_t>(l);
  if (local_rank < 0) return on_spare_exit(self, pid, exit_code);
  auto& r = st.ranks[local_rank];
  r.alive = false;
  r.peer.clear();
  auto detail = "rank " + std::to_string(local_rank) + " (pid " + std::to_string(pid) + ") exited with code " + std::to_string(exit_code) +
                exit_code_hint(exit_code);
  if (winding_down(st)) {
    report_rank(self, local_rank, pb::rank_status::STATE_EXITED, exit_code, detail);
    quit_if_done(self);
    return;
  }
  ++r.failures;
  if (exit_code != 0) ++st.exits_without_step;
  const auto limit = st.opts.rank_exit_limit;
  // The same death again and again (out of memory at the same step, a
  // crash there): restarting it only churns generations. The job goes on
  // with this node's other ranks; a node left with none leaves the job.
  r.given_up = exit_code != 0 && limit > 0 && st.exits_without_step >= static_cast<uint32_t>(limit);
  if (r.given_up) {
    detail += "; " + std::to_string(st.exits_without_step) + " rank exits on this node in a row without a completed step (cluster.rank_exit_limit = " +
              std::to_string(limit) + "): not restarting it";
    st.exits_without_step = 0;  // the node's next rank to go gets the same chances
  }
  const auto spare = r.given_up ? std::nullopt : hand_slot_to_spare(self, local_rank);
  if (spare) detail += "; a warm spare (pid " + std::to_string(*spare) + ") takes its place";
  report_rank(self, local_rank, pb::rank_status::STATE_EXITED, exit_code, detail, spare.has_value());
  if (spare) {
    log_line(self, detail);
    return;
  }
  if (!r.given_up) {
    log_line(self, detail + "; restarting");
    schedule_restart(self, local_rank);
    return;
  }
  log_line(self, detail);
  for (const auto& o : st.ranks)
    if (!o.given_up) return;
  emit(self, nev::gave_up{detail});
  leave(self, "every rank given up: " + detail, nullptr);
}

void leave(agent_self self, const std::string& reason, const pb::preemption_notice* notice) {
  auto& st = self->state;
  if (winding_down(st)) return;
  if (st.job_stopping) {
    // The coordinator already stops the job: not a preemption. The
    // ranks stop with the job (bounded by stop_timeout).
    log_line(self, "leaving: " + reason + "; the job is stopping, the ranks stop with it");
    wind_down(self, node_phase::leaving, reason, false);
    self->delayed_send(self, st.opts.stop_timeout, stop_due_atom::value);
    return;
  }
  const bool drain = st.phase == node_phase::running;
  if (member(st)) {
    auto env = envelope(self);
    env.mutable_leave()->set_reason(reason);
    env.mutable_leave()->set_at_step(st.last_step);
    env.mutable_leave()->set_draining(drain);
    if (notice) *env.mutable_leave()->mutable_notice() = *notice;
    to_coordinator(self, std::move(env));
  }
  log_line(self, "leaving: " + reason + (drain ? " (ranks finish their step first)" : ""));
  // While training, ranks keep going until the coordinator's drain plan
  // (without this node) lets them stop at a step boundary.
  wind_down(self, node_phase::leaving, reason, !drain);
  if (drain) self->delayed_send(self, st.opts.leave_timeout, leave_due_atom::value);
  quit_if_done(self);
}

// The register retry timer: another register while still registering
// (a stale epoch: an ack or a plan came meanwhile).
void on_register_retry(agent_self self, uint64_t epoch) {
  auto& st = self->state;
  if (st.phase != node_phase::registering || epoch != st.register_epoch) return;
  ++st.register_attempt;
  send_register(self);
  schedule_register_retry(self);
}

// A rank's restart delay passed: start it, unless the restart was
// cancelled (a newer epoch), it runs again, or the node winds down.
void on_restart_due(agent_self self, int32_t local_rank, uint64_t epoch) {
  auto& st = self->state;
  if (local_rank < 0 || local_rank >= static_cast<int32_t>(st.ranks.size())) return;
  auto& r = st.ranks[local_rank];
  if (epoch != r.restart_epoch || r.alive || winding_down(st)) return;
  // A spare warmed up meanwhile: it says STATE_IDLE as this rank, and is
  // planned in as a restarted process would be, a start sooner.
  if (const auto spare = hand_slot_to_spare(self, local_rank)) {
    log_line(self, "rank " + std::to_string(local_rank) + ": a warm spare (pid " + std::to_string(*spare) + ") takes its place");
    return;
  }
  start_rank(self, local_rank);
}

// The leave timeout: no drain plan came; stop the ranks now.
void on_leave_due(agent_self self) {
  auto& st = self->state;
  if (st.phase != node_phase::leaving) return;
  // The drain timer while the job stops: the stop's own timer decides.
  if (st.job_stopping) return;
  log_line(self, "stopping ranks: no drain plan in time");
  for (auto& r : st.ranks) stop_rank(self, r);
  quit_if_done(self);
}

// A connection to a coordinator address came up: whoever listens there now
// leads (a standby binds only once it holds the lease) or restarted, and
// adopts the running generation once its nodes registered. So a node
// registers with it at once instead of after the heartbeat timeout (a
// member) or its next retry (registering). An old leader still alive takes
// the register as a readmission; what the node follows is fenced by the
// lease epoch of what it hears, not by this.
void on_coordinator_reachable(agent_self self, const std::string& endpoint) {
  auto& st = self->state;
  if (member(st))
    enter_registering(self, "a coordinator listens at " + printable(endpoint) + " (its connection came up)");
  else if (st.phase == node_phase::registering)
    send_register(self);
}

// The stop timeout: the job is stopping and no final shutdown came; or the
// shutdown's grace passed and ranks told to end still run.
void on_stop_due(agent_self self) {
  auto& st = self->state;
  if (st.phase == node_phase::stopped) {
    std::string pids;
    for (const auto& r : st.ranks)
      if (r.alive) pids += (pids.empty() ? "" : ", ") + std::to_string(r.pid);
    if (pids.empty()) return;
    log_line(self, "terminating ranks still running " + std::to_string(st.opts.shutdown_grace.count()) + " ms after the shutdown (pid " + pids + ")");
    for (auto& r : st.ranks) stop_rank(self, r);
    return;
  }
  if (st.phase != node_phase::leaving) return;
  log_line(self, "stopping ranks: no final shutdown from the coordinator in time");
  for (auto& r : st.ranks) stop_rank(self, r);
  quit_if_done(self);
}

}  // namespace node_agent_detail

using namespace node_agent_detail;

node_agent_handle::behavior_type node_agent(agent_self self, node_agent_options opts, outbound out, std::shared_ptr<process_launcher> launcher) {
  auto& st = self->state;
  st.opts = std::move(opts);
  st.out = std::move(out);
  st.launcher = std::move(launcher);
  st.ranks.resize(static_cast<size_t>(std::max(st.opts.nproc, 0)));
  st.spares = spare_pool(st.opts.spare_pool);
  return {
      [=](start_atom) {
        if (self->state.phase != node_phase::unregistered) return;
        enter_registering(self, "start");
        self->send(self, tick_atom::value);
      },
      [=](retry_atom, uint64_t epoch) { on_register_retry(self, epoch); },
      [=](tick_atom) {
        if (self->state.phase == node_phase::stopped) return;
        on_tick(self);
        self->delayed_send(self, self->state.opts.liveness.heartbeat_interval, tick_atom::value);
      },
      [=](inbound& in) {
        if (in.link == links::ranks)
          on_rank(self, in);
        else if (in.link == links::relay_in)
          on_relay_member(self, in);
        else if (in.link == links::relay)
          on_relay_answer(self, in);
        else
          on_coordinator(self, in);
      },
      [=](rank_exit_atom, int32_t pid, int32_t exit_code) { on_rank_exit(self, pid, exit_code); },
      [=](restart_atom, int32_t local_rank, uint64_t epoch) { on_restart_due(self, local_rank, epoch); },
      [=](leave_atom, const std::string& reason) { leave(self, reason, nullptr); },
      // The cloud's preemption notice (app/node.cpp): a leave the coordinator
      // journals as preemption_notice.
      [=](leave_atom, const std::string& reason, const std::string& cloud, const std::string& announced, double announced_unix_s,
          double noticed_unix_s) {
        pb::preemption_notice n;
        n.set_cloud(cloud);
        n.set_announced_time(announced);
        n.set_announced_unix_s(announced_unix_s);
        n.set_noticed_unix_s(noticed_unix_s);
        leave(self, reason, &n);
      },
      [=](leave_due_atom) { on_leave_due(self); },
      [=](stop_due_atom) { on_stop_due(self); },
      [=](reachable_atom, const std::string& endpoint) { on_coordinator_reachable(self, endpoint); },
  };
}

}  // namespace dtactor
