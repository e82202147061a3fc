#pragma once
// Heartbeat relays (actors/relays.hpp) for the simulated nodes of
// bench/scale_nodes.cpp: the process's relay listener, a node's DEALER to
// its relay, and what a relay answers a member's beat, as a node agent does
// (actors/node_agent_relay.cpp). scale_nodes.cpp decides when each is used.
//
// A real node binds a listener of its own; a simulator process binds one
// for all its nodes, and finds the relay a member's beat is for by the
// member's node rank (a simulation shortcut: thousands of CURVE servers and
// ports per process would cost descriptors and nothing the coordinator
// sees). So a member's relay endpoint is its relay's process's: a member
// whose relay changes to another node of that process keeps its DEALER,
// and one that gives up a relay avoids every relay of that process for two
// heartbeat timeouts, not only the one that did not answer. And one stall
// of a simulator process (its one thread starved for a relay_grace) leaves
// every member of every relay there unanswered at once. A member's DEALER
// to its relay has no redial backoff (zmq_bridge's): libzmq redials it.
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "actors/relays.hpp"
#include "base/job_key.hpp"
#include "dtactor/result.hpp"
#include "net/wire.hpp"
#include "net/zap_handler.hpp"

namespace zmq {
class context_t;
}  // namespace zmq

namespace dtactor::scale_sim {

// libzmq's reconnect interval, zmq_bridge_options' default.
constexpr int reconnect_ivl_ms = 100;
// The relay listener's accept queue (relay_listener::open).
constexpr int listen_backlog = 4096;

// A node's DEALER as zmq_bridge opens it (net/zmq_bridge.cpp, app/node.cpp):
// its link to the coordinator and to its relay alike.
struct dealer_settings {
  int zmtp_heartbeat_ms = 1000;  // 0: off
  int reconnect_max_ms = 0;
  bool immediate = false;
};
// Socket options, CURVE client keys (the job's, pinned to its server key)
// and routing id; before connect.
void set_dealer_options(void* socket, const dealer_settings& s, const job_key& key, const std::string& routing_id);

// Every frame waiting on `socket` (a ROUTER's: routing id, then payload),
// decoded: on_frame(peer, envelope, payload bytes) until it returns false
// (the socket was closed meanwhile) or nothing waits; reading ZMQ_EVENTS
// also resets the socket's ZMQ_FD. Returns the frames that did not decode.
using frame_fn = std::function<bool(const std::string& peer, const pb::envelope& env, size_t bytes)>;
uint64_t drain_socket(void* socket, bool router, const frame_fn& on_frame);

// What a simulator process counts of relays (its stats line's relay_* keys).
struct relay_counters {
  uint64_t dials = 0;            // DEALERs dialled to a relay
  uint64_t beats = 0, acks = 0;  // beats sent to relays, their answers received
  uint64_t acks_late = 0;        // answers that came relay_grace or more after their beat
  uint64_t send_failed = 0, dropped = 0;
  uint64_t answers = 0;              // answers this process's relays sent to members' beats
  uint64_t refusals = 0;             // of which the coordinator's refusals passed on
  uint64_t unanswered = 0;           // beats to a relay here that was silent, closed or registering
  uint64_t not_here = 0;             // beats for a group no node here relays (told to beat the coordinator)
  uint64_t entries_sent = 0;         // members in relays' beats to the coordinator
  uint64_t give_ups = 0;             // relays given up
  uint64_t give_ups_unanswered = 0;  // of which relays that had not answered once since dialled
  // Loop rounds that began a relay_grace or more after the one before: the
  // process was starved, and every beat to a relay here went unanswered as
  // long (its members give it up).
  uint64_t loop_stalls = 0;
  nlohmann::json json() const;
};

// One simulated node's side of relays: node_agent_state's relay,
// group_relay and hub, and its DEALER to its relay.
struct relay_member {
  relay_link link;             // where it beats
  pb::relay_assignment group;  // its group's, as the coordinator last said it (passed on when it relays)
  relay_hub hub;               // its group's beats, when it relays
  void* socket = nullptr;      // DEALER to link.endpoint(), while that is set
  int fd = -1;                 // its ZMQ_FD, in the simulator's epoll
};

// What a member's relay DEALER is opened with: the simulator's context and
// epoll, and its DEALER settings and keys.
struct relay_sockets {
  void* ctx = nullptr;
  int epoll = -1;
  dealer_settings dealer;
  const job_key* key = nullptr;
};

// node_agent_relay.cpp's take_relay: m follows assignment `a` for node
// `self`, dialling its relay from `source` (its DEALER's routing id
// `routing_id`, watched with `tag` as its epoll data) or closing the DEALER
// to it. True when a DEALER was opened; an error line when one was not.
result<bool> take_assignment(relay_member& m, const pb::relay_assignment& a, const std::string& self, clock_time now, const relay_sockets& s,
                             uint64_t tag, const std::string& routing_id, const std::string& source);
// Back to the coordinator (a registration): drop_relay.
void forget(relay_member& m, int epoll);
// given_up_relay: a relay that left a beat unanswered for relay_grace is
// given up, avoided for two heartbeat timeouts and its DEALER closed; true
// then (the node beats the coordinator now).
bool give_up_if_due(relay_member& m, clock_time now, const liveness_options& l, int epoll);
// A beat to m's relay (every one answered). False: not sent.
bool send_beat(relay_member& m, const pb::envelope& env, clock_time now);
// Closes m's DEALER (linger 0), if open.
void hang_up(relay_member& m, int epoll);

// What relay `relay` answers a member's beat (node_agent_relay.cpp
// on_relay_member), in `out` (the relay's envelope): the coordinator's
// refusal of `member`, once, if it refused it; else the beat goes into the
// hub and the answer is a heartbeat_ack naming the group's relay and how
// long ago the relay heard the coordinator (at `relay_heard`).
pb::envelope answer_member(relay_member& relay, pb::envelope out, const pb::envelope& beat, const std::string& member, clock_time now,
                           clock_time relay_heard);

// The answer to a member's beat when no node of this process relays its
// group (see the header comment): from_relay, no relay named, so the member
// beats the coordinator.
pb::envelope not_relayed_here(pb::envelope out, const pb::envelope& beat);

// The process's listener for relayed beats: a ROUTER with the job's CURVE
// server keys and a ZAP handler that admits the job's client key, as a
// node's bridge opens links::relay_in.
class relay_listener {
 public:
  relay_listener() = default;
  ~relay_listener() { close(); }
  relay_listener(const relay_listener&) = delete;
  relay_listener& operator=(const relay_listener&) = delete;
  // Binds on `address` (a port the OS picks). Error: one line.
  status open(zmq::context_t& context, int zmtp_heartbeat_ms, const job_key& key, const std::string& address);
  const std::string& endpoint() const { return endpoint_; }  // tcp://ADDRESS:PORT
  int fd() const { return fd_; }
  // Every member beat waiting: on_frame(routing id, envelope). Returns the
  // frames that did not decode.
  uint64_t drain(const std::function<void(const std::string& peer, const pb::envelope& env)>& on_frame);
  // False: not sent (the member's connection is gone).
  bool reply(const std::string& peer, const pb::envelope& env);
  // Before the context closes.
  void close();

 private:
  std::unique_ptr<zap_handler> zap_;
  void* socket_ = nullptr;
  int fd_ = -1;
  std::string endpoint_;
};

}  // namespace dtactor::scale_sim
