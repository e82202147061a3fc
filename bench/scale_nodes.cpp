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
#include <sys/resource.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>
#include <zmq.hpp>

#include "base/job_key.hpp"
#include "base/printable.hpp"
#include "base/unix_time.hpp"
#include "bench/scale_nodes_args.hpp"
#include "bench/scale_nodes_relay.hpp"
#include "dtactor/config.hpp"
#include "job/settings.hpp"
#include "net/redial_backoff.hpp"
#include "net/wire.hpp"

namespace dtactor {
namespace {

using scale_sim::sim_options;
using steady = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;
// In an epoll event's data: a node's monitor, or its DEALER to its relay,
// not its DEALER to the coordinator; the relay listener; stdin.
constexpr uint64_t monitor_bit = uint64_t{1} << 62;
constexpr uint64_t relay_bit = uint64_t{1} << 61;
constexpr uint64_t listener_tag = UINT64_MAX - 1;
constexpr uint64_t stdin_tag = UINT64_MAX;

enum class phase : uint8_t { registering, member, stopped };

struct sim_node {
  std::string id;
  std::string source;
  void* socket = nullptr;
  int fd = -1;  // ZMQ_FD, watched by epoll
  void* monitor = nullptr;  // its socket monitor's PAIR (shed_redial_max_ms > 0)
  std::string endpoint;
  std::optional<dtactor::redial_backoff> redial;
  std::optional<std::chrono::steady_clock::time_point> redial_at;
  uint64_t incarnation = 0;
  uint64_t rank_incarnation = 0;
  phase ph = phase::registering;
  bool silent = false;
  bool closed = false;
  bool running = false;  // a plan named it
  uint64_t generation = 0;
  int32_t node_rank = -1;  // register_ack's
  int32_t global_rank = -1;
  int32_t world = 0;
  int64_t last_step = 0;
  int64_t report_slot = 0;  // wall-clock slot of the plan or the last report
  uint64_t hb_seq = 0;
  uint32_t register_attempt = 0;
  ms asked_every{0};  // the coordinator's heartbeat interval for it (0: the job's)
  steady::time_point last_beat{};
  steady::time_point ack_asked{};
  steady::time_point next_tick{};
  steady::time_point next_register{};
  steady::time_point last_heard{};
  double last_sent_unix = 0;
  scale_sim::relay_member relay;
  bool relay_answered = false;  // since its relay DEALER was dialled
};

struct counters {
  uint64_t sent = 0, send_failed = 0, received = 0, dropped = 0;
  uint64_t registers = 0, re_registers = 0, refusals = 0, plans = 0, reports = 0;
  uint64_t redials_held = 0;  // connections shut before their handshake, redialled after a backoff
  scale_sim::relay_counters relay;
};

// A node's routing id, its DEALER to the coordinator's and to its relay's alike.
std::string routing_id(const sim_node& n) { return sender_id::of_node(n.id).to_string() + "/" + std::to_string(n.incarnation); }

double steady_s(steady::time_point t) { return std::chrono::duration<double>(t.time_since_epoch()).count(); }

void print_line(const nlohmann::json& j) {
  std::fputs((j.dump() + "\n").c_str(), stdout);
  std::fflush(stdout);
}

class simulator {
 public:
  simulator(sim_options o, job_key key) : o_(std::move(o)), key_(std::move(key)) {}
  int run();

 private:
  status open_sockets();
  void close_sockets();
  void open_socket(sim_node& n, size_t index);
  scale_sim::dealer_settings dealer_settings() const { return {o_.zmtp_heartbeat_ms, o_.reconnect_max_ms, o_.immediate}; }
  void loop();
  void read_stdin();
  void drain(size_t index);
  void drain_monitor(size_t index);
  void open_monitor(sim_node& n, size_t index);
  void on_envelope(sim_node& n, const pb::envelope& env, size_t frame_bytes);
  void on_register_ack(sim_node& n, const pb::register_ack& ack);
  void on_plan(sim_node& n, const pb::generation_plan& plan, size_t frame_bytes);
  void timers(steady::time_point now);
  void tick(sim_node& n, steady::time_point now);
  void enter_registering(sim_node& n, steady::time_point now);
  void send_register(sim_node& n);
  void send_heartbeat(sim_node& n, steady::time_point now);
  void send_rank_status(sim_node& n, pb::rank_status::state s);
  void send_step_report(sim_node& n, int64_t slot);
  void send(sim_node& n, const pb::envelope& env);
  pb::envelope node_envelope(const sim_node& n) const;
  pb::envelope rank_envelope(const sim_node& n) const;
  void take_liveness(const std::string& config_toml);
  ms register_cap() const;
  void command(const std::string& line);
  void stop_nodes(const std::string& how, int count, bool relays_only);
  void print_stats();
  // Heartbeat relays (node_agent_relay.cpp's functions of the same names).
  void take_relay(sim_node& n, const pb::relay_assignment& a, steady::time_point now);
  void on_coordinator_ack(sim_node& n, const pb::heartbeat_ack& ack);
  void on_relay_answer(sim_node& n, const pb::envelope& env);
  bool given_up_relay(sim_node& n, steady::time_point now);
  void send_to_relay(sim_node& n, const pb::envelope& env, steady::time_point now);
  void drain_relay(size_t index);
  void on_member_beat(const std::string& peer, const pb::envelope& env);
  sim_node* group_relay(int32_t node_rank);
  void drain_touched();
  void answer_members();  // the member beats waiting on the listener
  liveness_options liveness() const {
    liveness_options l;
    l.heartbeat_interval = interval_;
    l.heartbeat_timeout = timeout_;
    return l;
  }

  sim_options o_;
  job_key key_;
  zmq::context_t context_;
  void* ctx_ = nullptr;  // context_'s
  int epoll_ = -1;
  std::vector<sim_node> nodes_;
  std::vector<uint64_t> touched_;  // sockets sent to since their last drain (a node's index, | relay_bit: its relay DEALER)
  std::minstd_rand random_{std::random_device{}()};
  ms interval_{100};                // liveness_options' defaults, as a node starts
  ms timeout_{1000};
  int32_t relay_group_size_ = 64;  // cluster.relay_group_size
  std::string parsed_config_;      // the config text the three above came from
  scale_sim::relay_listener listener_;
  scale_sim::relay_sockets relay_sockets_;            // what relay DEALERs open with
  std::unordered_map<int32_t, size_t> group_relays_;  // group -> the node here last told it relays that group
  std::string job_id_;
  counters c_;
  std::string stdin_buf_;
  bool quit_ = false;
};

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

// As zmq_bridge's open_socket: a monitor of the events its redial backoff reads.
void simulator::open_monitor(sim_node& n, size_t index) {
  const std::string at = "inproc://sim-monitor-" + std::to_string(index);
  if (zmq_socket_monitor(n.socket, at.c_str(), ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED) != 0) return;
  n.monitor = zmq_socket(ctx_, ZMQ_PAIR);
  int zero = 0;
  zmq_setsockopt(n.monitor, ZMQ_LINGER, &zero, sizeof zero);
  zmq_connect(n.monitor, at.c_str());
  int fd = -1;
  size_t len = sizeof fd;
  zmq_getsockopt(n.monitor, ZMQ_FD, &fd, &len);
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = index | monitor_bit;
  epoll_ctl(epoll_, EPOLL_CTL_ADD, fd, &e);
  n.redial.emplace(ms(100), ms(o_.shed_redial_max_ms));
  // An attempt to read marks its pipe idle, so that the next event wakes
  // its ZMQ_FD (which signals changes only).
  drain_monitor(index);
}

// zmq_bridge's schedule_redial: a connection shut before its handshake
// ended is disconnected and dialled again after the backoff.
void simulator::drain_monitor(size_t index) {
  auto& n = nodes_[index];
  for (;;) {
    if (n.closed || !n.monitor) return;
    int events = 0;
    size_t len = sizeof events;
    if (zmq_getsockopt(n.monitor, ZMQ_EVENTS, &events, &len) != 0 || !(events & ZMQ_POLLIN)) return;
    zmq_msg_t head, where;
    zmq_msg_init(&head);
    zmq_msg_init(&where);
    if (zmq_msg_recv(&head, n.monitor, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&head);
      zmq_msg_close(&where);
      return;
    }
    if (zmq_msg_more(&head)) zmq_msg_recv(&where, n.monitor, ZMQ_DONTWAIT);
    uint16_t event = 0;
    if (zmq_msg_size(&head) >= 6) std::memcpy(&event, zmq_msg_data(&head), sizeof event);
    zmq_msg_close(&head);
    zmq_msg_close(&where);
    if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) n.redial->on_handshake_succeeded();
    if (event != ZMQ_EVENT_DISCONNECTED || n.redial_at) continue;
    const auto delay = n.redial->on_disconnected(false, std::uniform_real_distribution<double>(0.0, 1.0)(random_));
    if (!delay || zmq_disconnect(n.socket, n.endpoint.c_str()) != 0) continue;
    n.redial_at = steady::now() + *delay;
    ++c_.redials_held;
  }
}

// Every frame the socket holds now; ZMQ_EVENTS also resets its ZMQ_FD.
void simulator::drain(size_t index) {
  auto& n = nodes_[index];
  if (n.closed || !n.socket) return;
  c_.dropped += scale_sim::drain_socket(n.socket, false, [&](const std::string&, const pb::envelope& env, size_t bytes) {
    ++c_.received;
    on_envelope(n, env, bytes);
    return true;
  });
}

// Its relay's answers (the DEALER may close on the way: a relay that says
// to beat the coordinator, a refusal that sends the node registering).
void simulator::drain_relay(size_t index) {
  auto& n = nodes_[index];
  if (n.closed || !n.relay.socket) return;
  c_.relay.dropped += scale_sim::drain_socket(n.relay.socket, false, [&](const std::string&, const pb::envelope& env, size_t) {
    ++c_.relay.acks;
    on_relay_answer(n, env);
    return n.relay.socket != nullptr;
  });
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
    if (n.redial_at && now >= *n.redial_at) {
      n.redial_at.reset();
      zmq_connect(n.socket, n.endpoint.c_str());
    }
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

void simulator::open_socket(sim_node& n, size_t index) {
  n.socket = zmq_socket(ctx_, ZMQ_DEALER);
  scale_sim::set_dealer_options(n.socket, dealer_settings(), key_, routing_id(n));
  const std::string hostport = o_.coordinator.substr(6);  // after "tcp://"
  const std::string endpoint = n.source.empty() ? o_.coordinator : "tcp://" + n.source + ":0;" + hostport;
  n.endpoint = endpoint;
  if (o_.shed_redial_max_ms > 0) open_monitor(n, index);
  if (zmq_connect(n.socket, endpoint.c_str()) != 0)
    print_line({{"event", "error"}, {"node", n.id}, {"what", std::string("connect: ") + zmq_strerror(zmq_errno())}});
  size_t len = sizeof n.fd;
  zmq_getsockopt(n.socket, ZMQ_FD, &n.fd, &len);
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = index;
  epoll_ctl(epoll_, EPOLL_CTL_ADD, n.fd, &e);
}

status simulator::open_sockets() {
  ctx_ = context_.handle();
  zmq_ctx_set(ctx_, ZMQ_IO_THREADS, o_.io_threads);
  // Each node's two DEALERs and its monitor's two PAIRs; the listener, its ZAP handler's.
  zmq_ctx_set(ctx_, ZMQ_MAX_SOCKETS, 4 * o_.nodes + 64);
  epoll_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_ < 0) return make_error(std::string("epoll_create1: ") + std::strerror(errno));
  if (auto st = listener_.open(context_, o_.zmtp_heartbeat_ms, key_, o_.sources.empty() ? std::string() : o_.sources.front()); !st) return st;
  relay_sockets_ = {ctx_, epoll_, dealer_settings(), &key_};
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = stdin_tag;
  epoll_ctl(epoll_, EPOLL_CTL_ADD, 0, &e);
  e.data.u64 = listener_tag;
  epoll_ctl(epoll_, EPOLL_CTL_ADD, listener_.fd(), &e);
  nodes_.resize(static_cast<size_t>(o_.nodes));
  const auto now = steady::now();
  for (size_t i = 0; i < nodes_.size(); ++i) {
    auto& n = nodes_[i];
    n.id = o_.prefix + "-" + std::to_string(i);
    n.source = o_.sources.empty() ? std::string() : o_.sources[i % o_.sources.size()];
    n.incarnation = wire::new_incarnation();
    n.rank_incarnation = wire::new_incarnation();
    open_socket(n, i);
    if (!n.socket) return make_error(std::string("cannot open a DEALER: ") + zmq_strerror(zmq_errno()));
    n.last_heard = now;
    enter_registering(n, now);
  }
  return status::success();
}

void simulator::close_sockets() {
  for (auto& n : nodes_) {
    scale_sim::hang_up(n.relay, epoll_);
    if (n.monitor) zmq_close(n.monitor);
    if (n.socket) zmq_close(n.socket);
    n.monitor = n.socket = nullptr;
  }
  listener_.close();
}

// "silent N" / "close N": the last N running nodes not yet stopped (with
// `relays_only`, of those that relay their group). A silent node sends
// nothing and answers no member; a closed one closes both its DEALERs.
void simulator::stop_nodes(const std::string& how, int count, bool relays_only) {
  for (auto it = nodes_.rbegin(); it != nodes_.rend() && count > 0; ++it) {
    auto& n = *it;
    if (!n.running || n.silent || n.closed || n.ph != phase::member) continue;
    if (relays_only && !n.relay.link.is_relay()) continue;
    --count;
    const double last_sent = n.last_sent_unix;
    const bool relay = n.relay.link.is_relay(), via_relay = !n.relay.link.endpoint().empty();
    if (how == "close") {
      epoll_ctl(epoll_, EPOLL_CTL_DEL, n.fd, nullptr);
      if (n.monitor) zmq_socket_monitor(n.socket, nullptr, 0);
      if (n.monitor) zmq_close(n.monitor);
      n.monitor = nullptr;
      zmq_close(n.socket);
      n.socket = nullptr;
      scale_sim::hang_up(n.relay, epoll_);
      n.closed = true;
    } else {
      n.silent = true;
    }
    print_line({{"event", how == "close" ? "closed" : "silenced"}, {"node", n.id}, {"t", unix_time_now()}, {"last_sent_t", last_sent},
                {"relay", relay}, {"via_relay", via_relay}, {"node_rank", n.node_rank}});
  }
}

void simulator::command(const std::string& line) {
  std::string word;
  int count = 0;
  char buf[32] = {0}, which[32] = {0};
  if (std::sscanf(line.c_str(), "%31s %d %31s", buf, &count, which) < 1) return;
  word = buf;
  if (word == "quit") {
    quit_ = true;
  } else if ((word == "silent" || word == "close") && count > 0 && (!which[0] || std::string(which) == "relays")) {
    stop_nodes(word, count, which[0] != 0);
  } else if (word == "stats") {
    print_stats();
  } else {
    print_line({{"event", "error"}, {"what", "unknown command: " + printable(line)}});
  }
}

void simulator::print_stats() {
  size_t registering = 0, members = 0, running = 0, stopped = 0, relays = 0, via_relay = 0, hub_entries = 0;
  int64_t asked_max = 0;  // the longest interval the coordinator asked a node to beat at
  for (const auto& n : nodes_) {
    if (n.closed || n.silent) continue;
    asked_max = std::max<int64_t>(asked_max, n.asked_every.count());
    registering += n.ph == phase::registering;
    members += n.ph == phase::member;
    running += n.ph == phase::member && n.running;
    stopped += n.ph == phase::stopped;
    relays += n.ph == phase::member && n.relay.link.is_relay();
    via_relay += n.ph == phase::member && !n.relay.link.endpoint().empty();
    hub_entries += n.relay.hub.size();
  }
  auto stats = c_.relay.json();
  stats.update(nlohmann::json{
      {"event", "stats"}, {"t", unix_time_now()}, {"registering", registering}, {"members", members}, {"running", running},
      {"stopped", stopped}, {"sent", c_.sent}, {"send_failed", c_.send_failed}, {"received", c_.received}, {"dropped", c_.dropped},
      {"registers", c_.registers}, {"re_registers", c_.re_registers}, {"refusals", c_.refusals}, {"plans", c_.plans},
      {"reports", c_.reports}, {"heartbeat_interval_ms", interval_.count()}, {"heartbeat_timeout_ms", timeout_.count()},
      {"asked_interval_ms_max", asked_max}, {"redials_held", c_.redials_held}, {"relays", relays}, {"via_relay", via_relay},
      {"relay_hub_entries", hub_entries}});
  print_line(stats);
}

// Every socket sent to since the last round (libzmq's FD may not signal
// again for frames that arrived during a send), and the relay listener,
// which answers on the same socket it reads (so it is read every round).
void simulator::drain_touched() {
  auto touched = std::move(touched_);
  touched_.clear();
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (uint64_t t : touched) {
    if (t & relay_bit)
      drain_relay(static_cast<size_t>(t & ~relay_bit));
    else
      drain(static_cast<size_t>(t));
  }
  answer_members();
}

void simulator::answer_members() {
  c_.relay.dropped += listener_.drain([&](const std::string& peer, const pb::envelope& env) { on_member_beat(peer, env); });
}

void simulator::read_stdin() {
  char buf[4096];
  const ssize_t r = ::read(0, buf, sizeof buf);
  if (r <= 0) {
    quit_ = true;  // the driver is gone
    return;
  }
  stdin_buf_.append(buf, static_cast<size_t>(r));
  for (size_t nl; (nl = stdin_buf_.find('\n')) != std::string::npos;) {
    command(stdin_buf_.substr(0, nl));
    stdin_buf_.erase(0, nl + 1);
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

}  // namespace
}  // namespace dtactor

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
  simulator sim(o.value(), key.value());
  return sim.run();
}
