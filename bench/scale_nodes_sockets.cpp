// The simulated nodes' sockets (bench/scale_nodes_sim.hpp): their DEALERs,
// the monitors that drive the redial backoff as zmq_bridge's do, the drains,
// and the commands read from stdin.
#include <sys/epoll.h>
#include <unistd.h>
#include <zmq.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "bench/scale_nodes_sim.hpp"

namespace dtactor::scale_sim {

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

// zmq_bridge's redial_due: the dial after a shed's backoff.
void simulator::redial_due(sim_node& n, steady::time_point now) {
  if (!n.redial_at || now < *n.redial_at) return;
  n.redial_at.reset();
  zmq_connect(n.socket, n.endpoint.c_str());
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

}  // namespace dtactor::scale_sim
