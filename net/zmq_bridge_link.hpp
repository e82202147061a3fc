#pragma once
// zmq_bridge's per-socket state, shared by its translation units
// (zmq_bridge.cpp: links, sends and receives; zmq_bridge_monitor.cpp: the
// socket monitor's events). Internal to net/: it includes ZeroMQ.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <zmq.hpp>

#include "net/dealer_group.hpp"
#include "net/handshake_gate.hpp"
#include "net/redial_backoff.hpp"
#include "net/zmq_bridge.hpp"

namespace dtactor {

// Messages (or monitor events) taken from one socket per poll round, so
// that one busy peer cannot starve the outbound queue or the other links.
constexpr int bridge_max_receives_per_round = 256;
// Distinct accepted connections remembered for their address.
constexpr std::size_t bridge_max_remembered_peers = 65536;

struct zmq_bridge::link_state {
  std::string name;
  bool router = false;
  std::string endpoint;
  zmq::socket_t socket;
  // libzmq's socket monitor (handshake events), read on the bridge thread.
  zmq::socket_t monitor;
  std::map<int, std::string> accepted;        // fd -> the peer's "ip:port" (ROUTER)
  // ROUTER: the connection (fd) each peer last sent a valid envelope on, and
  // back, so that a disconnect names the peer it cut off.
  std::map<std::string, int> fd_of_peer;
  std::map<int, std::string> peer_of_fd;
  std::optional<handshake_gate> gate;         // ROUTER: bounds connections in their handshake
  std::optional<handshake_failure> pending;   // a failure whose connection has not closed yet
  bool refused_us = false;                    // DEALER: the last handshake failed
  // DEALER: its backoff after connections shut before their handshake, and
  // when it dials again (its endpoint is disconnected until then).
  std::optional<redial_backoff> redial;
  std::optional<std::chrono::steady_clock::time_point> redial_at;
  uint64_t epoch = 0;                         // DEALER: the highest lease epoch received (a newer coordinator's)
  // DEALER to several endpoints: one link_state per endpoint, all of the
  // same name, sharing the group (its epoch replaces `epoch`).
  std::shared_ptr<dealer_group> group;
  std::size_t member = 0;
  ~link_state() {
    if (monitor) (void)zmq_socket_monitor(socket.handle(), nullptr, 0);
  }
};

}  // namespace dtactor
