// The socket monitor's side of zmq_bridge (net/zmq_bridge.hpp): handshakes
// that failed or succeeded, connections accepted and closed, read from
// libzmq's monitor socket of each link on the bridge thread.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <random>

#include "base/async_log.hpp"
#include "net/zmq_bridge_link.hpp"

namespace dtactor {

namespace {

std::string peer_address_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return {};
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (ss.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  } else {
    return "local";
  }
  return std::string(host) + ":" + std::to_string(port);
}

// What the failed handshake says about the peer.
handshake_failure classify(uint16_t event, uint32_t value) {
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) return handshake_failure::unknown_key;
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
    if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) return handshake_failure::no_key;
    if (value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC || value == ZMQ_PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE) return handshake_failure::unknown_key;
  }
  return handshake_failure::bad_frame;
}

const char* meaning(handshake_failure f) {
  switch (f) {
    case handshake_failure::no_key: return "its side and ours differ in having a job key (a process without --key, or one with a key for an open job)";
    case handshake_failure::unknown_key: return "its key is not this job's (another job's key, or an old one)";
    case handshake_failure::busy: return "too many connections were in their handshake at once (a flood?); it was shut down as it came, and a real peer retries";
    default: return "no valid handshake (garbage, an oversized frame, or a connection dropped or timed out mid-way)";
  }
}

}  // namespace

const char* to_string(handshake_failure f) noexcept {
  switch (f) {
    case handshake_failure::no_key: return "no_key";
    case handshake_failure::unknown_key: return "unknown_key";
    case handshake_failure::bad_frame: return "bad_frame";
    case handshake_failure::busy: return "busy";
    case handshake_failure::count_: break;
  }
  return "unknown";
}

void zmq_bridge::note_peer_fd(link_state& link, const std::string& peer, int fd) {
  if (fd < 0) return;
  auto known = link.fd_of_peer.find(peer);
  if (known != link.fd_of_peer.end() && known->second == fd) return;
  if (known == link.fd_of_peer.end() && link.fd_of_peer.size() >= bridge_max_remembered_peers) return;
  if (known != link.fd_of_peer.end()) link.peer_of_fd.erase(known->second);
  link.fd_of_peer[peer] = fd;
  link.peer_of_fd[fd] = peer;
}

void zmq_bridge::connection_closed(link_state& link, int fd) {
  // What came in before the close goes first: a heartbeat read after it
  // would look like a sign of life after it, and a peer whose first frames
  // arrive with the close would be unknown. (A newer connection that took
  // the same descriptor and already sent frames is read here too, before
  // its own accept event; it would be reported closed, and its next
  // heartbeat clears that.)
  receive_from(link);
  auto it = link.peer_of_fd.find(fd);
  if (it == link.peer_of_fd.end()) return;
  const std::string peer = it->second;
  link.peer_of_fd.erase(it);
  auto now_on = link.fd_of_peer.find(peer);
  if (now_on == link.fd_of_peer.end() || now_on->second != fd) return;  // it speaks on a newer connection
  link.fd_of_peer.erase(now_on);
  try {
    on_closed_(link.name, peer);
  } catch (const std::exception& e) {
    stderr_line(std::string("dtactor: wire: closed handler threw: ") + e.what());
  }
}

void zmq_bridge::handshake_failed(link_state& link, handshake_failure why, const std::string& address) {
  handshake_failures_[static_cast<std::size_t>(why)].fetch_add(1);
  const std::string cause = std::string("handshake ") + to_string(why) + " on " + link.name;
  if (link.router)
    log_limit_.log(cause, "dtactor: wire: refused a connection on link '" + link.name + "' from " + (address.empty() ? "?" : address) + ": " +
                              to_string(why) + ", " + meaning(why));
  else if (!on_handshake_)
    log_limit_.log(cause, "dtactor: wire: " + link.endpoint + " (link '" + link.name + "') refused our handshake: " + to_string(why) + ", " +
                              meaning(why));
  if (on_handshake_) {
    try {
      on_handshake_(link.name, link.router, why, address);
    } catch (const std::exception& e) {
      stderr_line(std::string("dtactor: wire: handshake handler threw: ") + e.what());
    }
  }
}

void zmq_bridge::connected(link_state& link) {
  if (!on_connected_) return;
  try {
    on_connected_(link.name, link.endpoint);
  } catch (const std::exception& e) {
    stderr_line(std::string("dtactor: wire: connected handler threw: ") + e.what());
  }
}

void zmq_bridge::schedule_redial(link_state& link, bool failure_reported) {
  if (!link.redial || link.redial_at) return;
  thread_local std::minstd_rand random{std::random_device{}()};
  const auto delay = link.redial->on_disconnected(failure_reported, std::uniform_real_distribution<double>(0.0, 1.0)(random));
  if (!delay) return;
  // Disconnecting ends libzmq's own redial (already scheduled) and drops
  // what was queued for the connection: a node's registrations, which it
  // retries anyway, would otherwise pile up there and all arrive at once.
  try {
    link.socket.disconnect(link.endpoint);
  } catch (const zmq::error_t& e) {
    stderr_line("dtactor: wire: link '" + link.name + "': cannot hold off a redial of " + link.endpoint + ": " + e.what());
    return;
  }
  link.redial_at = std::chrono::steady_clock::now() + *delay;
}

void zmq_bridge::redial_due(std::chrono::steady_clock::time_point now) {
  for (auto& l : links_) {
    if (!l->redial_at || *l->redial_at > now) continue;
    l->redial_at.reset();
    try {
      l->socket.connect(l->endpoint);
    } catch (const zmq::error_t& e) {
      stderr_line("dtactor: wire: link '" + l->name + "': cannot dial " + l->endpoint + " again: " + e.what());
    }
  }
}

void zmq_bridge::read_monitor(link_state& link) {
  read_monitor_events(link);
  uint64_t in_progress = 0;
  for (const auto& l : links_)
    if (l->gate) in_progress += l->gate->pending();
  handshakes_in_progress_.store(in_progress);
}

void zmq_bridge::read_monitor_events(link_state& link) {
  for (int i = 0; i < bridge_max_receives_per_round; ++i) {
    zmq::message_t head, where;
    try {
      if (!link.monitor.recv(head, zmq::recv_flags::dontwait)) return;
      if (head.more()) (void)link.monitor.recv(where, zmq::recv_flags::dontwait);
    } catch (const zmq::error_t&) {
      return;
    }
    if (head.size() < 6) continue;
    uint16_t event = 0;
    uint32_t value = 0;
    std::memcpy(&event, head.data(), sizeof event);
    std::memcpy(&value, static_cast<const char*>(head.data()) + 2, sizeof value);
    const int fd = static_cast<int>(value);
    using verdict = handshake_gate::verdict;
    const verdict v = link.gate ? link.gate->on_event(event, value, std::chrono::steady_clock::now()) : verdict::none;
    if (event == ZMQ_EVENT_ACCEPTED) {
      if (link.accepted.size() < bridge_max_remembered_peers) link.accepted[fd] = peer_address_of(fd);
    } else if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
      handshakes_succeeded_.fetch_add(1);
      link.refused_us = false;
      if (link.redial) link.redial->on_handshake_succeeded();
      if (link.group) link.group->up(link.member);
      if (!link.router) connected(link);
    } else if (event == ZMQ_EVENT_DISCONNECTED) {
      // libzmq's one I/O thread reports a failed handshake and then the
      // disconnect of the same connection, so the failure has its address.
      // A peer refused at the greeting (garbage on a keyed socket) gets no
      // failure event: the gate knows it closed mid-handshake.
      auto it = link.accepted.find(fd);
      const std::string address = it == link.accepted.end() ? std::string() : it->second;
      if (it != link.accepted.end()) link.accepted.erase(it);
      if (v == verdict::shed_closed)
        link.pending = handshake_failure::busy;
      else if (v == verdict::closed_in_handshake && !link.pending)
        link.pending = handshake_failure::bad_frame;
      if (link.pending) handshake_failed(link, *link.pending, address);
      // A shed connection reads as a handshake failed with no detail; only
      // a refused key is the peer's answer, left to libzmq's redials.
      if (!link.router)
        schedule_redial(link, link.pending == handshake_failure::no_key || link.pending == handshake_failure::unknown_key);
      link.pending.reset();
      if (link.router && on_closed_) connection_closed(link, fd);
      if (link.group) link.group->down(link.member);
    } else {
      if (link.pending) handshake_failed(link, *link.pending, "");
      link.pending = classify(event, value);
      if (!link.router) link.refused_us = true;
    }
  }
}

}  // namespace dtactor
