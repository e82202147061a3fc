// Simulated nodes for the coordinator's scale bench (bench/scale_nodes.py):
// one process plays K nodes, each a ZeroMQ DEALER to one real coordinator
// that speaks what a node agent speaks (actors/node_agent.cpp) with the
// job's CURVE client keys, and no rank process and no LibTorch.
//
// Per node: register_node (retried with the agent's backoff, capped at a
// third of the heartbeat timeout); on register_ack its one simulated rank
// says STATE_IDLE as a warmed-up rank does; a heartbeat every interval of
// the job's config (register_ack's config_toml, read as the agent reads
// it); back to registering after a heartbeat timeout without word from the
// coordinator, or when told it is no member; on a newer generation_plan that
// names it, STATE_READY for its rank, then step reports at wall-clock
// multiples of --report-every-s (all nodes report the same steps, so the
// coordinator completes them); shutdown stops it.
//
// Commands, one a line on stdin: "silent N" (N running nodes stop sending
// and keep their socket: a hung agent whose ZeroMQ thread still answers),
// "close N" (N running nodes close their socket at once, linger 0: a
// process that died), "quit"; "silent N relays" / "close N relays" pick
// nodes that relay their group. Output: JSON lines on stdout (times are
// CLOCK_REALTIME seconds, as the coordinator's journal's "t"): registered,
// plan (each node's receipt of each newer plan), silenced / closed, stats.
//
// Heartbeat relays (actors/relays.hpp), as node_agent_relay.cpp: every node
// registers with a relay endpoint; the register_ack's and every
// heartbeat_ack's relay assignment says where it beats: its relay (a second
// DEALER, every beat answered), or the coordinator (also when it is its
// group's relay: then its beats carry the members it heard). A relay left
// unanswered for relay_grace is given up for two heartbeat timeouts. The
// process binds ONE relay listener for all its nodes, where a real node
// binds its own (a shortcut, bench/scale_nodes_relay.hpp): a member's beat
// is answered by the node here that relays the group of the beat's node
// rank; a silent or closed relay answers nothing, and a beat for a group no
// node here relays is told to beat the coordinator.
#include <sys/epoll.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "bench/scale_nodes_sim.hpp"

namespace dtactor::scale_sim {


// The heartbeat and relay settings of the job, read from register_ack's
// config as the agent reads them (liveness_options_from_text): parsed once
// per text.
void simulator::take_liveness(const std::string& config_toml) {
  if (config_toml.empty() || config_toml == parsed_config_) return;
  parsed_config_ = config_toml;
  auto c = config::parse_toml(config_toml, "register_ack");
  if (!c) return;
  auto cluster = cluster_settings_of(c.value());
  if (!cluster) return;
  interval_ = cluster.value().heartbeat_interval;
  timeout_ = cluster.value().heartbeat_timeout;
  relay_group_size_ = std::max(1, cluster.value().relay_group_size);
}

// node_agent's register_backoff_cap: at most 1 s, at most a third of the timeout.
ms simulator::register_cap() const {
  if (o_.register_cap_ms > 0) return ms(o_.register_cap_ms);
  return std::min(ms(1000), std::max(timeout_ / 3, ms(1)));
}

pb::envelope simulator::node_envelope(const sim_node& n) const {
  envelope_header h;
  h.sender = sender_id::of_node(n.id).to_string();
  h.incarnation = n.incarnation;
  return make_envelope(h, n.generation);
}

// What a rank sends through its node: its own sender and incarnation.
pb::envelope simulator::rank_envelope(const sim_node& n) const {
  envelope_header h;
  h.sender = sender_id::of_rank(n.id, 0).to_string();
  h.incarnation = n.rank_incarnation;
  h.job_id = job_id_;
  return make_envelope(h, n.generation);
}

void simulator::send(sim_node& n, const pb::envelope& env) {
  if (n.closed || !n.socket) return;
  auto bytes = wire::encode(env);
  if (!bytes) return;
  if (zmq_send(n.socket, bytes.value().data(), bytes.value().size(), ZMQ_DONTWAIT) < 0) {
    ++c_.send_failed;
    return;
  }
  ++c_.sent;
  n.last_sent_unix = unix_time_now();
  touched_.push_back(static_cast<uint64_t>(&n - nodes_.data()));
}

void simulator::send_register(sim_node& n) {
  auto env = node_envelope(n);
  auto* r = env.mutable_register_node();
  r->set_node_id(n.id);
  r->set_advertise_addr(n.source);
  r->set_nproc(1);
  r->set_hostname(n.id);
  r->set_last_step(n.last_step);
  r->set_last_generation(n.generation);
  r->set_relay_endpoint(listener_.endpoint());
  if (n.ph != phase::registering || n.running) r->add_ready_ranks(0);
  ++c_.registers;
  send(n, env);
}

void simulator::enter_registering(sim_node& n, steady::time_point now) {
  if (n.ph == phase::member) ++c_.re_registers;
  n.ph = phase::registering;
  n.register_attempt = 0;
  scale_sim::forget(n.relay, epoll_);  // node_agent's drop_relay
  send_register(n);
  n.next_register = now + std::min(ms(100), register_cap());
}

void simulator::send_heartbeat(sim_node& n, steady::time_point now) {
  auto env = node_envelope(n);
  auto* hb = env.mutable_heartbeat();
  hb->set_seq(++n.hb_seq);
  hb->set_sent_steady_s(steady_s(now));
  hb->set_step(n.last_step);
  hb->set_node_rank(n.node_rank);
  n.last_beat = now;
  // node_agent_relay.cpp's send_heartbeat: to the relay, every beat answered;
  // or to the coordinator with the members this node relays, an ack asked
  // for every quarter timeout.
  if (!n.relay.link.endpoint().empty()) {
    send_to_relay(n, env, now);
    return;
  }
  n.relay.hub.fill(*hb, now, timeout_);
  c_.relay.entries_sent += static_cast<uint64_t>(hb->relayed_size());
  const bool ask = n.hb_seq == 1 || now - n.ack_asked >= timeout_ / 4;
  hb->set_no_ack(!ask);
  if (ask) n.ack_asked = now;
  send(n, env);
}

void simulator::send_rank_status(sim_node& n, pb::rank_status::state s) {
  auto env = rank_envelope(n);
  auto* st = env.mutable_rank_status();
  st->set_global_rank(s == pb::rank_status::STATE_IDLE ? -1 : n.global_rank);
  st->set_local_rank(0);
  st->set_status(s);
  st->set_step(n.last_step);
  if (s == pb::rank_status::STATE_READY) {
    st->set_state_source(pb::rank_status::ORIGIN_LOCAL);
    st->set_state_root(0);
    st->set_switch_s(0.001);
  }
  send(n, env);
}

void simulator::send_step_report(sim_node& n, int64_t slot) {
  n.last_step += (slot - n.report_slot) * o_.steps_per_report;
  n.report_slot = slot;
  auto env = rank_envelope(n);
  auto* r = env.mutable_step_report();
  r->set_step(n.last_step);
  r->set_global_rank(n.global_rank);
  r->set_world_size(n.world);
  r->set_loss(1.0);
  r->set_loss_mean(1.0);
  r->set_steps_covered(static_cast<int32_t>(o_.steps_per_report));
  r->set_step_s(o_.report_every_s);
  r->set_samples(o_.steps_per_report);
  r->set_lr(1e-3);
  r->set_node_id(n.id);
  ++c_.reports;
  send(n, env);
}

void simulator::on_register_ack(sim_node& n, const pb::register_ack& ack) {
  const auto now = steady::now();
  if (!ack.accepted()) {
    ++c_.refusals;
    if (n.ph == phase::member) enter_registering(n, now);
    return;
  }
  if (n.ph != phase::registering) return;  // a duplicate ack of a retried register
  n.ph = phase::member;
  if (job_id_.empty()) job_id_ = ack.job_id();
  take_liveness(ack.config_toml());
  n.node_rank = ack.node_rank();
  n.asked_every = ms(ack.heartbeat_interval_ms());
  take_relay(n, ack.relay(), now);
  n.next_tick = now + interval_;
  print_line({{"event", "registered"}, {"node", n.id}, {"t", unix_time_now()}});
  // Its rank is up and warmed at once (a real one loads its model first).
  if (!n.running) send_rank_status(n, pb::rank_status::STATE_IDLE);
}

void simulator::on_plan(sim_node& n, const pb::generation_plan& plan, size_t frame_bytes) {
  if (n.ph == phase::stopped || plan.generation() <= n.generation || plan.generation() == 0) return;
  const double t = unix_time_now();
  n.generation = plan.generation();
  n.world = plan.world_size();
  n.ph = phase::member;
  n.global_rank = -1;
  for (const auto& a : plan.ranks())
    if (a.node_id() == n.id && a.local_rank() == 0) n.global_rank = a.global_rank();
  n.running = n.global_rank >= 0;
  ++c_.plans;
  print_line({{"event", "plan"}, {"node", n.id}, {"generation", n.generation}, {"t", t}, {"in_plan", n.running}, {"world", n.world},
              {"bytes", frame_bytes}});
  if (!n.running) return;
  n.last_step = std::max(n.last_step, plan.start_step());
  n.report_slot = static_cast<int64_t>(t / o_.report_every_s);
  send_rank_status(n, pb::rank_status::STATE_READY);
}

void simulator::on_envelope(sim_node& n, const pb::envelope& env, size_t frame_bytes) {
  if (n.silent || n.ph == phase::stopped) return;  // a hung agent reads nothing either
  n.last_heard = steady::now();
  switch (env.body_case()) {
    case pb::envelope::kRegisterAck:
      on_register_ack(n, env.register_ack());
      break;
    case pb::envelope::kGenerationPlan:
      on_plan(n, env.generation_plan(), frame_bytes);
      break;
    case pb::envelope::kHeartbeatAck:
      on_coordinator_ack(n, env.heartbeat_ack());
      break;
    case pb::envelope::kShutdown:
      if (!env.shutdown().checkpoint()) n.ph = phase::stopped;
      break;
    default:
      break;
  }
}

// node_agent_relay.cpp's take_relay; a node told it relays its group is
// the one here that answers the group's beats.
void simulator::take_relay(sim_node& n, const pb::relay_assignment& a, steady::time_point now) {
  const auto index = static_cast<uint64_t>(&n - nodes_.data());
  const auto dialled = scale_sim::take_assignment(n.relay, a, n.id, now, relay_sockets_, index | relay_bit, routing_id(n), n.source);
  if (n.relay.link.is_relay() && n.node_rank >= 0) group_relays_[n.node_rank / relay_group_size_] = index;
  if (!dialled) print_line({{"event", "error"}, {"node", n.id}, {"what", dialled.message()}});
  if (!dialled || !dialled.value()) return;
  ++c_.relay.dials;
  n.relay_answered = false;
}

// node_agent_relay.cpp's on_coordinator_ack: where to beat; the interval
// asked of its own beats (a member beating a relay keeps its relay's); the
// relayed members the coordinator refused.
void simulator::on_coordinator_ack(sim_node& n, const pb::heartbeat_ack& ack) {
  take_relay(n, ack.relay(), steady::now());
  if (n.relay.link.endpoint().empty()) n.asked_every = ms(ack.interval_ms());
  if (ack.refused_size() > 0) n.relay.hub.refuse({ack.refused().begin(), ack.refused().end()});
}

// node_agent_relay.cpp's on_relay_answer: the coordinator's refusal passed
// on (register again), or the relay's ack (the coordinator heard as long ago
// as the relay heard it; the group's assignment).
void simulator::on_relay_answer(sim_node& n, const pb::envelope& env) {
  if (n.silent || n.ph != phase::member || n.relay.link.endpoint().empty()) return;
  const auto now = steady::now();
  if (env.body_case() == pb::envelope::kRegisterAck && !env.register_ack().accepted()) {
    n.relay.link.acked(now);
    return on_register_ack(n, env.register_ack());
  }
  if (env.body_case() != pb::envelope::kHeartbeatAck || !env.heartbeat_ack().from_relay()) return;
  const auto& ack = env.heartbeat_ack();
  n.relay.link.acked(now);
  n.relay_answered = true;
  c_.relay.acks_late += steady_s(now) - ack.echoed_sent_steady_s() >= std::chrono::duration<double>(relay_grace(liveness())).count();
  n.last_heard = std::max(n.last_heard, now - ms(ack.coordinator_age_ms()));
  take_relay(n, ack.relay(), now);
  if (!n.relay.link.endpoint().empty()) n.asked_every = ms(ack.interval_ms());
}

// node_agent_relay.cpp's given_up_relay.
bool simulator::given_up_relay(sim_node& n, steady::time_point now) {
  if (!scale_sim::give_up_if_due(n.relay, now, liveness(), epoll_)) return false;
  ++c_.relay.give_ups;
  c_.relay.give_ups_unanswered += !n.relay_answered;
  n.asked_every = ms(0);
  return true;
}

void simulator::send_to_relay(sim_node& n, const pb::envelope& env, steady::time_point now) {
  if (!scale_sim::send_beat(n.relay, env, now)) {
    ++c_.relay.send_failed;
    return;
  }
  ++c_.relay.beats;
  n.last_sent_unix = unix_time_now();
  touched_.push_back(static_cast<uint64_t>(&n - nodes_.data()) | relay_bit);
}

// The node here that relays the group of node rank `node_rank`, as it was
// last told (it may since have been told another relays it: it answers with
// that, as a real node does); null when none here was.
sim_node* simulator::group_relay(int32_t node_rank) {
  if (node_rank < 0) return nullptr;
  const int32_t group = node_rank / relay_group_size_;
  auto it = group_relays_.find(group);
  if (it == group_relays_.end()) return nullptr;
  auto& n = nodes_[it->second];
  if (n.node_rank < 0 || n.node_rank / relay_group_size_ != group) {
    group_relays_.erase(it);  // it registered again at another rank
    return nullptr;
  }
  return &n;
}

// A member's beat on the listener, answered as its group's relay would
// (node_agent_relay.cpp on_relay_member): nothing from a hung, dead or
// registering relay; "beat the coordinator" when none here relays it.
void simulator::on_member_beat(const std::string& peer, const pb::envelope& env) {
  const auto from = sender_id::parse(env.sender());
  if (env.body_case() != pb::envelope::kHeartbeat || from.who != sender_id::role::node) return;
  sim_node* relay = group_relay(env.heartbeat().node_rank());
  if (relay && (relay->silent || relay->closed || relay->ph != phase::member)) {
    ++c_.relay.unanswered;
    return;
  }
  envelope_header h;
  h.sender = sender_id::of_node(relay ? relay->id : o_.prefix + "-listener").to_string();
  h.incarnation = relay ? relay->incarnation : 0;
  h.job_id = job_id_;
  pb::envelope out = make_envelope(h, relay ? relay->generation : 0);
  if (relay) {
    out = scale_sim::answer_member(relay->relay, std::move(out), env, from.node, steady::now(), relay->last_heard);
    ++c_.relay.answers;
    c_.relay.refusals += out.body_case() == pb::envelope::kRegisterAck;
  } else {
    out = scale_sim::not_relayed_here(std::move(out), env);
    ++c_.relay.not_here;
  }
  if (!listener_.reply(peer, out)) ++c_.relay.send_failed;
}


// What the agent's tick does, per node: the coordinator's silence, the
// heartbeat, and (for its rank) a step report when the wall-clock slot moved.
void simulator::tick(sim_node& n, steady::time_point now) {
  n.next_tick = now + interval_;
  if (now - n.last_heard >= timeout_) {
    enter_registering(n, now);
    return;
  }
  // node_agent's beat_due: ticks every configured interval, a beat on the
  // tick nearest a whole asked-for interval after the last one; at once to
  // the coordinator when the relay was just given up.
  const bool gave_up = given_up_relay(n, now);
  const ms every = n.asked_every.count() > 0 ? n.asked_every : interval_;
  if (!gave_up && n.hb_seq != 0 && now - n.last_beat + interval_ / 2 < every) return;
  send_heartbeat(n, now);
  if (!n.running) return;
  const auto slot = static_cast<int64_t>(unix_time_now() / o_.report_every_s);
  if (slot > n.report_slot) send_step_report(n, slot);
}

void simulator::timers(steady::time_point now) {
  for (auto& n : nodes_) {
    if (n.closed || n.silent || n.ph == phase::stopped) continue;
    redial_due(n, now);
    if (n.ph == phase::registering && now >= n.next_register) {
      ++n.register_attempt;
      send_register(n);
      auto delay = ms(100);
      for (uint32_t i = 0; i < n.register_attempt && delay < register_cap(); ++i) delay *= 2;
      n.next_register = now + std::min(delay, register_cap());
    } else if (n.ph == phase::member && now >= n.next_tick) {
      tick(n, now);
    }
  }
}

// One thread: epoll over the sockets' ZMQ_FDs and stdin, the timers every
// few milliseconds, and a drain of every socket sent to.
void simulator::loop() {
  std::vector<epoll_event> ready(1024);
  auto next_stats = steady::now(), last_round = next_stats;
  while (!quit_) {
    const int got = epoll_wait(epoll_, ready.data(), static_cast<int>(ready.size()), 5);
    bool command_waits = false;
    for (int i = 0; i < got; ++i) {
      const uint64_t which = ready[i].data.u64;
      if (which == stdin_tag)
        command_waits = true;
      else if (which == listener_tag)
        continue;  // read every round
      else if (which & monitor_bit)
        drain_monitor(static_cast<size_t>(which & ~monitor_bit));
      else if (which & relay_bit)
        drain_relay(static_cast<size_t>(which & ~relay_bit));
      else
        drain(static_cast<size_t>(which));
    }
    // What waited, before the members' timers judge their relays, and before
    // a command silences or closes a node: a beat that reached a relay's
    // socket before its member stopped is heard before it stopped.
    answer_members();
    if (command_waits) read_stdin();
    if (quit_) break;
    const auto now = steady::now();
    c_.relay.loop_stalls += now - last_round >= relay_grace(liveness());
    last_round = now;
    timers(now);
    drain_touched();
    if (now >= next_stats) {
      print_stats();
      next_stats = now + std::chrono::duration_cast<steady::duration>(std::chrono::duration<double>(o_.stats_every_s));
    }
  }
}

int simulator::run() {
  if (auto st = open_sockets(); !st) {
    print_line({{"event", "error"}, {"what", "cannot open the sockets: " + st.message()}});
    close_sockets();
    return 1;
  }
  print_line({{"event", "started"}, {"t", unix_time_now()}, {"nodes", o_.nodes}, {"prefix", printable(o_.prefix)},
              {"relay_listener", listener_.endpoint()}});
  loop();
  print_stats();
  close_sockets();
  context_.close();
  return 0;
}

}  // namespace dtactor::scale_sim

int main(int argc, char** argv) {
  using namespace dtactor;
  auto o = scale_sim::parse_args(argc, argv);
  if (!o) {
    std::fprintf(stderr, "scale_nodes: %s\n%s", o.message().c_str(), scale_sim::usage);
    return 2;
  }
  auto key = load_job_key(o.value().key_path);
  if (!key) {
    std::fprintf(stderr, "scale_nodes: %s\n", printable(key.message(), 0).c_str());
    return 2;
  }
  scale_sim::raise_fd_limit(o.value().nodes);
  scale_sim::simulator sim(o.value(), key.value());
  return sim.run();
}
