#include "net/zmq_bridge.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <random>
#include <cstring>
#include <future>
#include <map>
#include <optional>
#include <zmq.hpp>

#include "base/async_log.hpp"
#include "base/printable.hpp"
#include "net/zap_handler.hpp"
#include "net/zmq_bridge_link.hpp"

namespace dtactor {

namespace {

// Distinct (kind, link, peer) triples logged; beyond it drops are only counted.
constexpr std::size_t max_logged_keys = 4096;
// Upper bound on one poll when nothing wakes us: a safety net only.
constexpr std::chrono::milliseconds idle_poll{1000};

std::string hint_for(int err) {
  switch (err) {
    case EADDRINUSE: return "; another process listens there: stop it or choose another port";
    case EADDRNOTAVAIL: return "; that address is not one of this machine's: use 0.0.0.0 or a local IP";
    case EINVAL: return "; expected e.g. tcp://0.0.0.0:29400, tcp://host:29400 or ipc:///path";
    case EPROTONOSUPPORT: return "; supported transports: tcp://, ipc://";
    case EACCES: return "; permission denied: use a port above 1023 or a writable ipc path";
    default: return "";
  }
}

// The port of a bound endpoint ("tcp://1.2.3.4:5555" -> 5555); 0 for none.
int port_of(const std::string& endpoint) {
  const auto colon = endpoint.rfind(':');
  if (colon == std::string::npos || endpoint.compare(0, 6, "tcp://") != 0) return 0;
  try {
    return std::stoi(endpoint.substr(colon + 1));
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

struct zmq_bridge::outbound {
  std::string link;
  std::string peer;
  std::string bytes;
  const char* body = "none";
  bool to_all = false;  // on a DEALER link of several endpoints (dealer_group.hpp)
};

struct zmq_bridge::command {
  // Runs on the bridge thread; `stopping` means the bridge is shutting down
  // and the command must only report failure.
  std::function<void(bool stopping)> run;
};

uint64_t zmq_bridge_stats::dropped_total() const {
  uint64_t n = 0;
  for (auto v : dropped) n += v;
  return n;
}

zmq_bridge::zmq_bridge(zmq_bridge_options options, inbound_handler on_envelope,
                       drop_handler on_drop, handshake_handler on_handshake, closed_handler on_closed,
                       connected_handler on_connected)
    : options_(std::move(options)),
      on_envelope_(std::move(on_envelope)),
      on_drop_(std::move(on_drop)),
      on_handshake_(std::move(on_handshake)),
      on_closed_(std::move(on_closed)),
      on_connected_(std::move(on_connected)),
      job_id_(options_.job_id) {
  for (auto& d : dropped_) d.store(0);
  for (auto& h : handshake_failures_) h.store(0);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  context_ = std::make_unique<zmq::context_t>(1);
  if (options_.key) {
    auto zap = zap_handler::start(*context_, {curve_key_binary(options_.key->client_public)}, "wire");
    if (!zap) {
      stderr_line("dtactor: " + zap.message() + "; the ZeroMQ bridge is not running");
      std::lock_guard<std::mutex> lock(mutex_);
      stopped_ = true;
      return;
    }
    zap_ = std::move(zap.value());
  }
  if (wake_fd_ < 0) {
    // Without a wake fd the thread would only notice work once per idle_poll;
    // refuse to run rather than be silently slow.
    stderr_line(std::string("dtactor: wire: eventfd failed (") + std::strerror(errno) + "); the ZeroMQ bridge is not running");
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    return;
  }
  thread_ = std::thread([this] { run(); });
}

zmq_bridge::~zmq_bridge() {
  stop();
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void zmq_bridge::stop(std::chrono::milliseconds flush) {
  if (!stop_requested_.load()) flush_ms_.store(static_cast<int>(std::max<int64_t>(0, flush.count())));
  stop_requested_.store(true);
  wake();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void zmq_bridge::wake() {
  if (wake_fd_ < 0) return;
  if (!wake_pending_.exchange(true)) {
    uint64_t one = 1;
    // EAGAIN only when the counter is saturated, which still means "awake".
    [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
  }
}

void zmq_bridge::drain_wake_fd() {
  uint64_t value = 0;
  while (::read(wake_fd_, &value, sizeof value) > 0) {
  }
  wake_pending_.store(false);
}

void zmq_bridge::post(std::unique_ptr<command> cmd) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!stopped_) {
      commands_.push_back(std::move(cmd));
      cmd = nullptr;
    }
  }
  if (cmd) {
    cmd->run(true);
    return;
  }
  wake();
}

result<std::string> zmq_bridge::add_link(const std::string& link, const std::string& endpoint,
                                         bool router, const std::string& routing_id) {
  if (thread_.get_id() == std::this_thread::get_id())
    return make_error("wire: add_router/add_dealer called from the bridge thread (link '" + link +
                      "'); call it from another thread");
  auto promise = std::make_shared<std::promise<result<std::string>>>();
  auto future = promise->get_future();
  auto cmd = std::make_unique<command>();
  cmd->run = [this, promise, link, endpoint, router, routing_id](bool stopping) {
    if (stopping)
      promise->set_value(make_error("wire: cannot add link '" + link + "': the bridge is stopped"));
    else
      promise->set_value(run_add(link, endpoint, router, routing_id));
  };
  post(std::move(cmd));
  return future.get();
}

result<std::string> zmq_bridge::add_router(const std::string& link, const std::string& endpoint) {
  return add_link(link, endpoint, true, {});
}

result<std::string> zmq_bridge::add_dealer(const std::string& link, const std::string& endpoint,
                                           const std::string& routing_id) {
  if (routing_id.empty() || routing_id.size() > 255 || routing_id[0] == '\0')
    return make_error("wire: link '" + link + "': routing id must be 1-255 bytes not starting with a zero byte");
  return add_link(link, endpoint, false, routing_id);
}

status zmq_bridge::remove_link(const std::string& link) {
  if (thread_.get_id() == std::this_thread::get_id()) {
    // From a handler: links_ is being iterated, so remove it on the next round.
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!link_names_.count(link))
        return make_error("wire: cannot remove link '" + link + "': no such link");
    }
    auto cmd = std::make_unique<command>();
    cmd->run = [this, link](bool stopping) {
      if (!stopping) run_remove(link);
    };
    post(std::move(cmd));
    return status::success();
  }
  auto promise = std::make_shared<std::promise<status>>();
  auto future = promise->get_future();
  auto cmd = std::make_unique<command>();
  cmd->run = [this, promise, link](bool stopping) {
    if (stopping)
      promise->set_value(make_error("wire: cannot remove link '" + link + "': the bridge is stopped"));
    else
      promise->set_value(run_remove(link));
  };
  post(std::move(cmd));
  return future.get();
}

status zmq_bridge::send(const std::string& link, const std::string& peer, const pb::envelope& env) {
  auto bytes = wire::encode(env);
  if (!bytes) return bytes.err();
  if (static_cast<int64_t>(bytes->size()) > options_.max_message_bytes)
    return make_error("wire: cannot send " + std::string(wire::body_name(env)) + " on link '" + link + "': " + std::to_string(bytes->size()) +
                      " bytes, over the control plane's limit of " + std::to_string(options_.max_message_bytes) +
                      " bytes (peers would drop the connection)");
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopped_) return make_error("wire: cannot send on link '" + link + "': the bridge is stopped");
    if (!link_names_.count(link))
      return make_error("wire: cannot send on link '" + link + "': no such link");
    if (queue_.size() >= options_.max_queued_sends) {
      dropped_[static_cast<std::size_t>(wire::drop_kind::send_overflow)].fetch_add(1);
      return make_error("wire: cannot send on link '" + link + "': " +
                        std::to_string(queue_.size()) + " messages already waiting");
    }
    queue_.push_back(outbound{link, peer, std::move(bytes).value(), wire::body_name(env), env.body_case() == pb::envelope::kRegisterNode});
  }
  wake();
  return status::success();
}

void zmq_bridge::set_job_id(std::string job_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  job_id_ = std::move(job_id);
}

uint64_t zmq_bridge::refused_handshakes() const { return zap_ ? zap_->refused() : 0; }

zmq_bridge_stats zmq_bridge::stats() const {
  zmq_bridge_stats s;
  s.received = received_.load();
  s.sent = sent_.load();
  for (std::size_t i = 0; i < wire::drop_kind_count; ++i) s.dropped[i] = dropped_[i].load();
  for (std::size_t i = 0; i < handshake_failure_count; ++i) s.handshake_failures[i] = handshake_failures_[i].load();
  s.handshakes_succeeded = handshakes_succeeded_.load();
  s.handshakes_in_progress = handshakes_in_progress_.load();
  s.handshakes_shed = s.handshake_failures[static_cast<std::size_t>(handshake_failure::busy)];
  return s;
}

// ---- bridge thread ----

result<std::string> zmq_bridge::run_add(const std::string& name, const std::string& endpoint,
                                        bool router, const std::string& routing_id) {
  for (auto& l : links_)
    if (l->name == name) return make_error("wire: a link named '" + name + "' already exists");
  // A DEALER given "A,B,...": a socket per endpoint (dealer_group.hpp).
  std::vector<std::string> endpoints;
  for (size_t at = 0; at <= endpoint.size() && !router;) {
    const size_t comma = std::min(endpoint.find(',', at), endpoint.size());
    endpoints.push_back(endpoint.substr(at, comma - at));
    at = comma + 1;
  }
  if (router) endpoints.push_back(endpoint);
  auto group = endpoints.size() > 1 ? std::make_shared<dealer_group>(endpoints.size()) : nullptr;
  std::vector<std::unique_ptr<link_state>> made;
  for (std::size_t i = 0; i < endpoints.size(); ++i) {
    auto link = std::make_unique<link_state>();
    link->name = name;
    link->router = router;
    link->group = group;
    link->member = i;
    try {
      open_socket(*link, endpoints[i], routing_id);
    } catch (const zmq::error_t& e) {
      return make_error("wire: cannot " + std::string(router ? "bind" : "connect") + " link '" +
                        name + "' to '" + endpoint + "': " + e.what() + hint_for(e.num()));
    }
    made.push_back(std::move(link));
  }
  std::string bound = router ? made.front()->endpoint : endpoint;
  for (auto& link : made) links_.push_back(std::move(link));
  std::lock_guard<std::mutex> lock(mutex_);
  link_names_.insert(name);
  return bound;
}

void zmq_bridge::open_socket(link_state& link, const std::string& endpoint, const std::string& routing_id) {
  const bool router = link.router;
  link.socket = zmq::socket_t(*context_, router ? zmq::socket_type::router : zmq::socket_type::dealer);
  auto& s = link.socket;
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::maxmsgsize, options_.max_message_bytes);
  s.set(zmq::sockopt::handshake_ivl, options_.handshake_timeout_ms);
  // Before bind/connect, so that the first connection's events are seen.
  static std::atomic<uint64_t> monitors{0};
  const std::string monitor_ep = "inproc://dtactor-monitor-" + std::to_string(monitors.fetch_add(1));
  if (zmq_socket_monitor(s.handle(), monitor_ep.c_str(), handshake_gate::monitored_events()) != 0) throw zmq::error_t();
  link.monitor = zmq::socket_t(*context_, zmq::socket_type::pair);
  link.monitor.set(zmq::sockopt::linger, 0);
  link.monitor.connect(monitor_ep);
  s.set(zmq::sockopt::sndhwm, options_.send_hwm);
  s.set(zmq::sockopt::rcvhwm, options_.recv_hwm);
  s.set(zmq::sockopt::tcp_keepalive, 1);
  s.set(zmq::sockopt::tcp_keepalive_idle, options_.tcp_keepalive_idle_s);
  s.set(zmq::sockopt::tcp_keepalive_intvl, options_.tcp_keepalive_intvl_s);
  s.set(zmq::sockopt::tcp_keepalive_cnt, options_.tcp_keepalive_cnt);
  if (options_.zmtp_heartbeat_ivl_ms > 0) {
    s.set(zmq::sockopt::heartbeat_ivl, options_.zmtp_heartbeat_ivl_ms);
    s.set(zmq::sockopt::heartbeat_timeout, options_.zmtp_heartbeat_timeout_ms);
  }
  if (options_.key) {
    if (router)
      make_curve_server(s, options_.key->server_secret);
    else
      make_curve_client(s, options_.key->server_public, options_.key->client_public, options_.key->client_secret);
  }
  if (router) {
    // Unknown peers fail the send (counted) instead of vanishing silently;
    // a peer reconnecting with the same id (a restarted node) takes over.
    s.set(zmq::sockopt::router_mandatory, true);
    s.set(zmq::sockopt::router_handover, true);
    s.bind(endpoint);
    link.endpoint = s.get(zmq::sockopt::last_endpoint);
    link.gate.emplace(options_.max_pending_handshakes, options_.max_pending_handshakes_per_address, port_of(link.endpoint),
                      std::chrono::milliseconds(options_.handshake_timeout_ms));
    return;
  }
  s.set(zmq::sockopt::routing_id, routing_id);
  s.set(zmq::sockopt::reconnect_ivl, options_.reconnect_ivl_ms);
  s.set(zmq::sockopt::reconnect_ivl_max, link.group ? options_.group_reconnect_ivl_max_ms : options_.reconnect_ivl_max_ms);
  // One of several endpoints (of which one leader listens): a message is
  // refused while this one's connection has not completed its handshake,
  // rather than queued for a peer that is not there.
  if (link.group) s.set(zmq::sockopt::immediate, true);
  s.connect(endpoint);
  link.endpoint = endpoint;
  link.redial.emplace(std::chrono::milliseconds(options_.reconnect_ivl_ms), std::chrono::milliseconds(options_.shed_redial_max_ms));
}

status zmq_bridge::run_remove(const std::string& name) {
  // Closes the sockets (every endpoint's); linger 0 discards what is queued.
  const auto kept = std::remove_if(links_.begin(), links_.end(), [&](const auto& l) { return l->name == name; });
  if (kept == links_.end()) return make_error("wire: cannot remove link '" + name + "': no such link");
  links_.erase(kept, links_.end());
  std::lock_guard<std::mutex> lock(mutex_);
  link_names_.erase(name);
  return status::success();
}

void zmq_bridge::drop(const std::string& link, const std::string& peer, wire::drop_kind kind,
                      const std::string& why) {
  std::string key = std::string(wire::to_string(kind)) + '\0' + link + '\0' + peer;
  // A DEALER link's peer is the one at its other end: it has no routing id to name.
  const std::string from = peer.empty() ? std::string() : ", peer '" + printable_routing_id(peer) + "'";
  if (logged_.size() < max_logged_keys && logged_.insert(std::move(key)).second)
    log_limit_.log(wire::to_string(kind), "dtactor: wire: dropped " + std::string(wire::to_string(kind)) + " frame, link '" + link + "'" + from +
                                              ": " + printable(why, printable_max_detail_chars) +
                                              (peer.empty() ? " (further ones on this link are counted, not logged)"
                                                            : " (further ones from this peer are counted, not logged)"));
  count_drop(link, peer, kind);
}

void zmq_bridge::count_drop(const std::string& link, const std::string& peer, wire::drop_kind kind) {
  dropped_[static_cast<std::size_t>(kind)].fetch_add(1);
  if (on_drop_) {
    try {
      on_drop_(link, peer, kind);
    } catch (const std::exception& e) {
      stderr_line(std::string("dtactor: wire: drop handler threw: ") + e.what());
    }
  }
}

void zmq_bridge::do_sends(std::deque<outbound>& batch) {
  for (auto& out : batch) {
    link_state* link = nullptr;
    for (auto& l : links_)
      if (l->name == out.link) link = l.get();
    if (!link) {
      drop(out.link, out.peer, wire::drop_kind::unroutable, "the link was removed");
      continue;
    }
    // Zero-copy: ZeroMQ frees the string once the bytes are on the wire.
    auto* owned = new std::string(std::move(out.bytes));
    zmq::message_t payload(
        owned->data(), owned->size(), [](void*, void* hint) { delete static_cast<std::string*>(hint); },
        owned);
    try {
      if (link->router) {
        zmq::message_t id(out.peer.data(), out.peer.size());
        if (!link->socket.send(id, zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
          drop(out.link, out.peer, wire::drop_kind::send_overflow,
               std::string("cannot send ") + out.body + ": the peer's queue is full");
          continue;
        }
      }
      if (link->group) {
        send_to_group(*link, out, payload);
        continue;
      }
      if (!link->socket.send(payload, zmq::send_flags::dontwait)) {
        drop(out.link, out.peer, wire::drop_kind::send_overflow,
             std::string("cannot send ") + out.body +
                 (link->refused_us  ? ": no connection, the peer refused our handshake (our key, or we have none)"
                  : link->redial_at ? ": no connection, the peer shut it before its handshake (busy); it is dialled again shortly"
                                    : ": the queue to the peer is full"));
        continue;
      }
      sent_.fetch_add(1);
    } catch (const zmq::error_t& e) {
      if (e.num() == EHOSTUNREACH)
        drop(out.link, out.peer, wire::drop_kind::unroutable,
             std::string("cannot send ") + out.body + ": no such peer is connected");
      else
        drop(out.link, out.peer, wire::drop_kind::unroutable,
             std::string("cannot send ") + out.body + ": " + e.what());
    }
  }
}

void zmq_bridge::send_to_group(link_state& link, outbound& out, zmq::message_t& payload) {
  std::vector<zmq::socket_t*> sockets(link.group->size(), nullptr);
  for (auto& l : links_)
    if (l->group == link.group) sockets[l->member] = &l->socket;
  if (link.group->send(sockets, payload, out.to_all) > 0) {
    sent_.fetch_add(1);
    return;
  }
  // No connection is up (none has come up yet: a node's first registration,
  // sent while its standbys do not listen; or every one closed): nowhere to
  // send it, nothing to say; a node registers again as a connection comes
  // up. Counted all the same. A connection up that refused it is full.
  if (!link.group->any_up()) {
    count_drop(out.link, out.peer, wire::drop_kind::send_overflow);
    return;
  }
  drop(out.link, out.peer, wire::drop_kind::send_overflow,
       std::string("cannot send ") + out.body + ": the queue of every connection up to the link's endpoints is full");
}

void zmq_bridge::receive_from(link_state& link) {
  const std::size_t expected_parts = link.router ? 2 : 1;
  for (int i = 0; i < bridge_max_receives_per_round; ++i) {
    std::array<zmq::message_t, 3> parts;
    std::size_t n = 0;
    bool more = true;
    try {
      while (more) {
        zmq::message_t m;
        if (!link.socket.recv(m, zmq::recv_flags::dontwait)) {
          more = false;
          break;
        }
        more = m.more();
        if (n < parts.size()) parts[n] = std::move(m);
        ++n;
      }
    } catch (const zmq::error_t& e) {
      stderr_line("dtactor: wire: receive on link '" + link.name + "' failed: " + e.what());
      return;
    }
    if (n == 0) return;  // nothing more waiting
    std::string peer = link.router ? parts[0].to_string() : std::string();
    if (n != expected_parts) {
      drop(link.name, peer, wire::drop_kind::bad_multipart,
           "a message of " + std::to_string(link.router ? n - 1 : n) + " frames, expected 1");
      continue;
    }
    const auto& payload = parts[expected_parts - 1];
    std::string job;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job = job_id_;
    }
    auto env = wire::decode(payload.data(), payload.size(), job);
    if (!env) {
      drop(link.name, peer, env.kind(), env.message());
      continue;
    }
    if (!link.router && !follows_epoch(link, env.value().epoch())) continue;
    // ZMQ_SRCFD: the connection the frame came in on (deprecated in libzmq,
    // yet the only stable way to tie a routing id to its connection). The
    // payload's: the routing id frame ROUTER builds after a poll has none.
    if (link.router && on_closed_) note_peer_fd(link, peer, zmq_msg_get(payload.handle(), ZMQ_SRCFD));
    received_.fetch_add(1);
    try {
      on_envelope_(link.name, peer, std::move(env).value());
    } catch (const std::exception& e) {
      stderr_line("dtactor: wire: envelope handler threw on link '" + link.name + "': " + e.what());
    }
  }
}

bool zmq_bridge::follows_epoch(link_state& link, uint64_t epoch) {
  // A DEALER follows one coordinator at a time: once a newer lease epoch
  // spoke, an older one (a deposed coordinator, partitioned) is dropped.
  const uint64_t newest = link.group ? link.group->epoch() : link.epoch;
  if (epoch < newest) {
    drop(link.name, "", wire::drop_kind::stale_epoch,
         "a message of lease epoch " + std::to_string(epoch) + ", older than epoch " + std::to_string(newest) +
             " already heard: a deposed coordinator");
    return false;
  }
  if (link.group)
    link.group->heard(link.member, epoch);
  else
    link.epoch = epoch;
  return true;
}

std::chrono::milliseconds zmq_bridge::poll_timeout(std::chrono::steady_clock::time_point now) const {
  auto timeout = idle_poll;
  for (const auto& l : links_)
    if (l->redial_at)
      timeout = std::min(timeout, std::max(std::chrono::milliseconds(0), std::chrono::ceil<std::chrono::milliseconds>(*l->redial_at - now)));
  return timeout;
}

void zmq_bridge::run() {
  std::vector<zmq_pollitem_t> items;
  for (;;) {
    std::deque<outbound> batch;
    std::deque<std::unique_ptr<command>> commands;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      batch.swap(queue_);
      commands.swap(commands_);
    }
    for (auto& c : commands) c->run(false);
    do_sends(batch);
    if (stop_requested_.load()) break;

    items.clear();
    items.push_back(zmq_pollitem_t{nullptr, wake_fd_, ZMQ_POLLIN, 0});
    for (auto& l : links_) {
      items.push_back(zmq_pollitem_t{l->socket.handle(), 0, ZMQ_POLLIN, 0});
      items.push_back(zmq_pollitem_t{l->monitor.handle(), 0, ZMQ_POLLIN, 0});
    }
    try {
      zmq::poll(items, poll_timeout(std::chrono::steady_clock::now()));
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      stderr_line(std::string("dtactor: wire: poll failed: ") + e.what() + "; the ZeroMQ bridge stops");
      break;
    }
    if (items[0].revents & ZMQ_POLLIN) drain_wake_fd();
    redial_due(std::chrono::steady_clock::now());
    // links_ is unchanged since items were built (only this thread edits it).
    // The monitor first: a connection's disconnect is read before the
    // frames of a newer one that may reuse its file descriptor.
    for (std::size_t i = 0; i < links_.size(); ++i) {
      if (items[2 + 2 * i].revents & ZMQ_POLLIN) read_monitor(*links_[i]);
      if (items[1 + 2 * i].revents & ZMQ_POLLIN) receive_from(*links_[i]);
    }
  }

  std::deque<std::unique_ptr<command>> leftover;
  std::deque<outbound> last;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopped_ = true;
    leftover.swap(commands_);
    last.swap(queue_);
    link_names_.clear();
  }
  for (auto& c : leftover) c->run(true);
  const int flush_ms = flush_ms_.load();
  if (flush_ms > 0) {
    // What was sent before stop() goes out, within the deadline: the last
    // batch is handed to ZeroMQ, and closing waits (linger) until it is on
    // the wire or the deadline passed.
    do_sends(last);
    for (auto& l : links_) l->socket.set(zmq::sockopt::linger, flush_ms);
  }
  links_.clear();  // closes every socket (linger 0 unless flushing)
  zap_.reset();    // its socket too, or close() would wait for it
  context_->close();  // returns once lingering messages are sent or timed out
}

// ---- helpers ----

namespace {

// The lowest port of the kernel's range for ports nobody asked for by
// number (connect(), and bind() to port 0, as Gloo's and ZeroMQ's peers do).
int ephemeral_port_floor() {
  int first = 32768, last = 60999;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    if (std::fscanf(f, "%d %d", &first, &last) != 2) first = 32768;
    std::fclose(f);
  }
  return first;
}

// Whether `port` can be bound on every interface now (nobody listens or is
// connected on it, on any address).
bool port_free_now(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const bool free = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return free;
}

}  // namespace

result<int> pick_free_tcp_port() {
  // Below the ephemeral range, at a random place: the ports the system hands
  // out to connections and port-0 listeners (the busiest source of a
  // collision between choosing and binding) never land there.
  const int first = ephemeral_port_floor();
  const int low = 10000, high = first > low + 1000 ? first - 1 : 0;
  if (high > 0) {
    // Not one this process handed out lately and nobody has bound yet.
    static std::mutex m;
    static std::deque<int> recent;
    std::lock_guard<std::mutex> lock(m);
    std::random_device seed;
    std::mt19937 pick(seed());
    std::uniform_int_distribution<int> in_range(low, high);
    for (int tries = 0; tries < 200; ++tries) {
      const int port = in_range(pick);
      if (std::find(recent.begin(), recent.end(), port) != recent.end() || !port_free_now(port)) continue;
      recent.push_back(port);
      if (recent.size() > 256) recent.pop_front();
      return port;
    }
  }
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return make_error(std::string("cannot create a TCP socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    return make_error("cannot find a free TCP port on 127.0.0.1: " + why);
  }
  ::close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

std::string connectable_endpoint(const std::string& bound, const std::string& host) {
  for (const char* any : {"tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:", "tcp://[*]:"}) {
    const std::string prefix = any;
    if (bound.compare(0, prefix.size(), prefix) == 0)
      return "tcp://" + host + ":" + bound.substr(prefix.size());
  }
  return bound;
}

std::string printable_routing_id(const std::string& id) {
  bool text = !id.empty();
  for (unsigned char c : id)
    if (c < 0x20 || c > 0x7e) text = false;
  if (text) return printable(id);
  // libzmq's own ids (a zero byte and four random ones) and other binary
  // ids in hex, the first 32 bytes.
  static const char* digits = "0123456789abcdef";
  std::string out = "0x";
  for (std::size_t i = 0; i < id.size() && i < 32; ++i) {
    const unsigned char c = static_cast<unsigned char>(id[i]);
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  if (id.size() > 32) out += "...(" + std::to_string(id.size()) + " bytes)";
  return out;
}

}  // namespace dtactor
