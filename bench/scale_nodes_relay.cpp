#include "bench/scale_nodes_relay.hpp"

#include <sys/epoll.h>
#include <zmq.h>

#include <algorithm>
#include <optional>
#include <zmq.hpp>

namespace dtactor::scale_sim {

namespace {

void set_int(void* socket, int opt, int v) { zmq_setsockopt(socket, opt, &v, sizeof v); }

// As zmq_bridge's open_socket, for both kinds.
void set_common_options(void* socket, int zmtp_heartbeat_ms) {
  const int64_t max_msg = wire::max_control_message_bytes;
  zmq_setsockopt(socket, ZMQ_MAXMSGSIZE, &max_msg, sizeof max_msg);
  set_int(socket, ZMQ_LINGER, 0);
  set_int(socket, ZMQ_HANDSHAKE_IVL, wire::handshake_timeout_ms);
  set_int(socket, ZMQ_SNDHWM, 10000);
  set_int(socket, ZMQ_RCVHWM, 10000);
  set_int(socket, ZMQ_TCP_KEEPALIVE, 1);
  set_int(socket, ZMQ_TCP_KEEPALIVE_IDLE, 30);
  set_int(socket, ZMQ_TCP_KEEPALIVE_INTVL, 5);
  set_int(socket, ZMQ_TCP_KEEPALIVE_CNT, 3);
  if (zmtp_heartbeat_ms > 0) {
    set_int(socket, ZMQ_HEARTBEAT_IVL, zmtp_heartbeat_ms);
    set_int(socket, ZMQ_HEARTBEAT_TIMEOUT, 5 * zmtp_heartbeat_ms);
  }
}

uint32_t age_ms(clock_time now, clock_time then) {
  const auto age = std::chrono::duration_cast<std::chrono::milliseconds>(now - std::min(now, then)).count();
  return static_cast<uint32_t>(std::min<int64_t>(age, UINT32_MAX));
}

// The parts of a message after those expected: read and dropped. True
// when there were any.
bool skip_rest(void* socket, const zmq_msg_t& last) {
  if (!zmq_msg_more(const_cast<zmq_msg_t*>(&last))) return false;
  zmq_msg_t rest;
  zmq_msg_init(&rest);
  while (zmq_msg_recv(&rest, socket, ZMQ_DONTWAIT) >= 0 && zmq_msg_more(&rest)) {
  }
  zmq_msg_close(&rest);
  return true;
}

}  // namespace

void set_dealer_options(void* socket, const dealer_settings& s, const job_key& key, const std::string& routing_id) {
  set_common_options(socket, s.zmtp_heartbeat_ms);
  set_int(socket, ZMQ_RECONNECT_IVL, reconnect_ivl_ms);
  set_int(socket, ZMQ_RECONNECT_IVL_MAX, s.reconnect_max_ms);
  set_int(socket, ZMQ_IMMEDIATE, s.immediate ? 1 : 0);
  zmq_setsockopt(socket, ZMQ_CURVE_SERVERKEY, key.server_public.data(), key.server_public.size());
  zmq_setsockopt(socket, ZMQ_CURVE_PUBLICKEY, key.client_public.data(), key.client_public.size());
  zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, key.client_secret.data(), key.client_secret.size());
  zmq_setsockopt(socket, ZMQ_ROUTING_ID, routing_id.data(), routing_id.size());
}

uint64_t drain_socket(void* socket, bool router, const frame_fn& on_frame) {
  uint64_t bad = 0;
  std::string peer;
  for (;;) {
    int events = 0;
    size_t len = sizeof events;
    if (zmq_getsockopt(socket, ZMQ_EVENTS, &events, &len) != 0 || !(events & ZMQ_POLLIN)) return bad;
    zmq_msg_t head, body;
    zmq_msg_init(&head);
    zmq_msg_init(&body);
    if (zmq_msg_recv(&head, socket, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&head);
      zmq_msg_close(&body);
      return bad;
    }
    zmq_msg_t* payload = &head;
    bool whole = true;
    if (router) {
      peer.assign(static_cast<const char*>(zmq_msg_data(&head)), zmq_msg_size(&head));
      whole = zmq_msg_more(&head) && zmq_msg_recv(&body, socket, ZMQ_DONTWAIT) >= 0;
      payload = &body;
    }
    // A message of more parts than expected is dropped whole.
    whole = whole && !skip_rest(socket, *payload);
    const size_t bytes = zmq_msg_size(payload);
    std::optional<wire::decoded> env;
    if (whole) env.emplace(wire::decode(zmq_msg_data(payload), bytes, ""));
    zmq_msg_close(&head);
    zmq_msg_close(&body);
    if (!env || !*env) {
      ++bad;
      continue;
    }
    if (!on_frame(peer, env->value(), bytes)) return bad;
  }
}

namespace {

bool dial(relay_member& m, const relay_sockets& s, uint64_t tag, const std::string& routing_id, const std::string& source,
          const std::string& endpoint) {
  hang_up(m, s.epoll);
  m.socket = zmq_socket(s.ctx, ZMQ_DEALER);
  if (!m.socket) return false;
  set_dealer_options(m.socket, s.dealer, *s.key, routing_id);
  const std::string at = source.empty() || endpoint.rfind("tcp://", 0) != 0 ? endpoint : "tcp://" + source + ":0;" + endpoint.substr(6);
  if (zmq_connect(m.socket, at.c_str()) != 0) {
    hang_up(m, s.epoll);
    return false;
  }
  size_t len = sizeof m.fd;
  zmq_getsockopt(m.socket, ZMQ_FD, &m.fd, &len);
  epoll_event e{};
  e.events = EPOLLIN;
  e.data.u64 = tag;
  epoll_ctl(s.epoll, EPOLL_CTL_ADD, m.fd, &e);
  return true;
}

}  // namespace

result<bool> take_assignment(relay_member& m, const pb::relay_assignment& a, const std::string& self, clock_time now, const relay_sockets& s,
                             uint64_t tag, const std::string& routing_id, const std::string& source) {
  m.group = a;
  const auto endpoint = m.link.assign(a, self, now);
  if (!endpoint) return false;
  if (endpoint->empty()) {
    hang_up(m, s.epoll);
    return false;
  }
  if (!dial(m, s, tag, routing_id, source, *endpoint)) return make_error("cannot dial relay " + *endpoint + ": " + zmq_strerror(zmq_errno()));
  return true;
}

void forget(relay_member& m, int epoll) {
  m.link.reset();
  m.group.Clear();
  hang_up(m, epoll);
}

bool give_up_if_due(relay_member& m, clock_time now, const liveness_options& l, int epoll) {
  if (!m.link.given_up(now, relay_grace(l), relay_first_grace(l), 2 * l.heartbeat_timeout)) return false;
  hang_up(m, epoll);
  return true;
}

bool send_beat(relay_member& m, const pb::envelope& env, clock_time now) {
  m.link.beat(now);
  auto bytes = wire::encode(env);
  return m.socket && bytes && zmq_send(m.socket, bytes.value().data(), bytes.value().size(), ZMQ_DONTWAIT) >= 0;
}

void hang_up(relay_member& m, int epoll) {
  if (!m.socket) return;
  if (m.fd >= 0) epoll_ctl(epoll, EPOLL_CTL_DEL, m.fd, nullptr);
  zmq_close(m.socket);
  m.socket = nullptr;
  m.fd = -1;
}

pb::envelope answer_member(relay_member& relay, pb::envelope out, const pb::envelope& beat, const std::string& member, clock_time now,
                           clock_time relay_heard) {
  if (relay.hub.take_refusal(member)) {
    auto* ack = out.mutable_register_ack();
    ack->set_accepted(false);
    ack->set_node_rank(-1);
    ack->set_job_id(out.job_id());
    ack->set_reason("node '" + member + "' is not a member (declared lost, restarted, or the coordinator restarted); register again");
    return out;
  }
  relay.hub.heard(member, relay_hub::beat{beat.incarnation(), beat.generation(), beat.heartbeat().step(), now});
  auto* ack = out.mutable_heartbeat_ack();
  ack->set_seq(beat.heartbeat().seq());
  ack->set_echoed_sent_steady_s(beat.heartbeat().sent_steady_s());
  *ack->mutable_relay() = relay.group;
  ack->set_interval_ms(relay.group.interval_ms());
  ack->set_from_relay(true);
  ack->set_coordinator_age_ms(age_ms(now, relay_heard));
  return out;
}

pb::envelope not_relayed_here(pb::envelope out, const pb::envelope& beat) {
  auto* ack = out.mutable_heartbeat_ack();
  ack->set_seq(beat.heartbeat().seq());
  ack->set_echoed_sent_steady_s(beat.heartbeat().sent_steady_s());
  ack->set_from_relay(true);
  return out;
}

nlohmann::json relay_counters::json() const {
  return {{"relay_dials", dials},
          {"relay_beats_sent", beats},
          {"relay_acks_received", acks},
          {"relay_acks_late", acks_late},
          {"relay_send_failed", send_failed},
          {"relay_dropped", dropped},
          {"relay_answers", answers},
          {"relay_refusals_passed", refusals},
          {"relay_unanswered", unanswered},
          {"relay_not_here", not_here},
          {"relayed_entries_sent", entries_sent},
          {"relay_give_ups", give_ups},
          {"relay_give_ups_unanswered", give_ups_unanswered},
          {"loop_stalls", loop_stalls}};
}

status relay_listener::open(zmq::context_t& context, int zmtp_heartbeat_ms, const job_key& key, const std::string& address) {
  auto zap = zap_handler::start(context, {curve_key_binary(key.client_public)}, "relay listener");
  if (!zap) return make_error("cannot start the relay listener's ZAP handler: " + zap.message());
  zap_ = std::move(zap.value());
  socket_ = zmq_socket(context.handle(), ZMQ_ROUTER);
  if (!socket_) return make_error(std::string("cannot open the relay listener: ") + zmq_strerror(zmq_errno()));
  set_common_options(socket_, zmtp_heartbeat_ms);
  set_int(socket_, ZMQ_CURVE_SERVER, 1);
  zmq_setsockopt(socket_, ZMQ_CURVE_SECRETKEY, key.server_secret.data(), key.server_secret.size());
  zmq_setsockopt(socket_, ZMQ_ZAP_DOMAIN, "dtactor", 7);
  set_int(socket_, ZMQ_ROUTER_MANDATORY, 1);
  set_int(socket_, ZMQ_ROUTER_HANDOVER, 1);
  // Every member of every relay of this process dials this one listener
  // (where a real relay takes its group's): room for a process's dials at
  // once in the kernel's accept queue (the kernel caps it at somaxconn),
  // not libzmq's default 100, past which a SYN is dropped and retried 1 s
  // later.
  set_int(socket_, ZMQ_BACKLOG, listen_backlog);
  const std::string at = "tcp://" + (address.empty() ? std::string("127.0.0.1") : address) + ":*";
  if (zmq_bind(socket_, at.c_str()) != 0) return make_error("cannot bind the relay listener on " + at + ": " + zmq_strerror(zmq_errno()));
  char last[256] = {0};
  size_t len = sizeof last;
  zmq_getsockopt(socket_, ZMQ_LAST_ENDPOINT, last, &len);
  endpoint_ = last;
  len = sizeof fd_;
  zmq_getsockopt(socket_, ZMQ_FD, &fd_, &len);
  return status::success();
}

uint64_t relay_listener::drain(const std::function<void(const std::string& peer, const pb::envelope& env)>& on_frame) {
  if (!socket_) return 0;
  return drain_socket(socket_, true, [&](const std::string& peer, const pb::envelope& env, size_t) {
    on_frame(peer, env);
    return true;
  });
}

bool relay_listener::reply(const std::string& peer, const pb::envelope& env) {
  auto bytes = wire::encode(env);
  if (!socket_ || !bytes) return false;
  if (zmq_send(socket_, peer.data(), peer.size(), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return false;
  return zmq_send(socket_, bytes.value().data(), bytes.value().size(), ZMQ_DONTWAIT) >= 0;
}

void relay_listener::close() {
  if (socket_) zmq_close(socket_);
  socket_ = nullptr;
  fd_ = -1;
  zap_.reset();
}

}  // namespace dtactor::scale_sim
