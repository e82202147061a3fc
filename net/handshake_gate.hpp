#pragma once
// Bounds the connections of one listening ZeroMQ socket that are still in
// their ZMTP (and CURVE) handshake, and tells which of them were refused.
//
// libzmq reads a whole frame, up to ZMQ_MAXMSGSIZE, before the handshake has
// authenticated anyone, and it has no limit on connections in the handshake:
// without a gate a stranger's N connections hold N x the largest frame for up
// to ZMQ_HANDSHAKE_IVL. The gate follows the socket monitor's events and
// shuts down a connection as it is accepted while `max_pending` others are
// still in their handshake, or `max_per_address` others from the same
// address. What strangers can hold before they authenticate is then at most
// max_pending x the largest frame per socket, and one address cannot take
// every place: real peers from other addresses still get in while it
// floods. A real peer shed during a flood reconnects (ZMQ_RECONNECT_IVL).
//
// What the events say, in libzmq 4.3: a connection ends its handshake with
// one HANDSHAKE_SUCCEEDED (which names no connection) or one
// HANDSHAKE_FAILED_* event directly followed by its DISCONNECTED, except a
// peer refused at the greeting by a socket with ZAP (garbage, ZMTP 1.0),
// which gets a DISCONNECTED only. The gate therefore keeps the descriptors
// accepted and not yet known done; a success marks the oldest of them done
// (handshakes finish in about the order they start), and one older than the
// handshake limit is done whatever happened to it. The count is exact; which
// connection a success belongs to is a guess that the limit corrects.
//
// Not thread-safe: one owner, the thread that reads the socket's monitor.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

namespace dtactor {

class handshake_gate {
 public:
  using clock = std::chrono::steady_clock;

  enum class verdict : uint8_t {
    none,
    shed,            // the connection just accepted was shut down: too many in their handshake
    closed_in_handshake,  // a connection closed before its handshake ended, with no failure event of its own
    shed_closed,     // a shed connection's DISCONNECTED
  };

  // `listen_port`: the socket's TCP port; a connection is only shut down
  // when its descriptor still is a connection to that port (a descriptor
  // closed and reused meanwhile is left alone). `handshake_limit`: the
  // socket's ZMQ_HANDSHAKE_IVL.
  handshake_gate(std::size_t max_pending, std::size_t max_per_address, int listen_port, std::chrono::milliseconds handshake_limit)
      : max_pending_(max_pending), max_per_address_(max_per_address), port_(listen_port), limit_(handshake_limit) {}

  // The events a socket monitor must report for the gate (ZMQ_EVENT_* bits).
  static int monitored_events();

  // Feeds one monitor event: its ZMQ_EVENT_* number and value (for ACCEPTED
  // and DISCONNECTED, the file descriptor).
  verdict on_event(uint16_t event, uint32_t value, clock::time_point now);

  std::size_t pending() const { return pending_.size(); }
  uint64_t shed() const { return shed_; }
  std::size_t max_pending() const { return max_pending_; }

 private:
  struct connection {
    clock::time_point accepted;
    std::string address;  // the peer's IP address, without its port
    bool shed = false;
  };
  void expire(clock::time_point now);
  void mark_oldest_done();
  bool over_limits(int fd, const std::string& address) const;
  bool shut_down(int fd) const;

  std::size_t max_pending_;
  std::size_t max_per_address_;
  int port_;
  std::chrono::milliseconds limit_;
  std::map<int, connection> pending_;  // fd -> accepted, handshake not known done
  bool failure_seen_ = false;          // a HANDSHAKE_FAILED_* event awaits its DISCONNECTED
  uint64_t shed_ = 0;
};

}  // namespace dtactor
