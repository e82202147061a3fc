#pragma once
// The one place a process touches ZeroMQ. A zmq_bridge owns a context and a
// thread; that thread creates, uses and closes every socket (ROUTERs that
// bind, DEALERs that connect), so no socket is ever shared between threads.
// Other threads talk to it only through send() (a locked queue plus an
// eventfd that wakes the thread) and receive through a callback that runs on
// the bridge thread.
//
// Liveness is decided above this layer (heartbeats): ZeroMQ reconnects
// silently. What the bridge adds is the one fast signal TCP gives: a ROUTER
// peer's connection closed (its process ended and its kernel sent FIN or
// RST), reported to the closed handler. A machine that goes silent closes
// nothing; only heartbeats find it.
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dtactor/result.hpp"
#include "base/job_key.hpp"
#include "base/log_limiter.hpp"
#include "net/wire.hpp"

namespace zmq {
class context_t;
class message_t;
}

namespace dtactor {

class zap_handler;

struct zmq_bridge_options {
  // Frames over this size make ZeroMQ drop the sending peer's connection
  // (ZMQ_MAXMSGSIZE) as soon as their header arrives; send() refuses
  // envelopes over it (wire.hpp says why it is small).
  int64_t max_message_bytes = wire::max_control_message_bytes;
  // A connection that has not finished its handshake after this long is
  // dropped (ZMQ_HANDSHAKE_IVL).
  int handshake_timeout_ms = wire::handshake_timeout_ms;
  // A ROUTER shuts down a connection as it is accepted while this many others
  // are in their handshake, or the per-address number from its address
  // (net/handshake_gate.hpp): what strangers hold before authenticating is
  // at most max_pending_handshakes x max_message_bytes.
  std::size_t max_pending_handshakes = wire::max_pending_handshakes;
  std::size_t max_pending_handshakes_per_address = wire::max_pending_handshakes_per_address;
  int send_hwm = 10000;  // messages queued per peer in ZeroMQ
  int recv_hwm = 10000;
  // Messages waiting for the bridge thread; beyond it send() refuses.
  std::size_t max_queued_sends = 100000;
  // DEALER reconnect backoff: starts at reconnect_ivl, doubles up to the max.
  int reconnect_ivl_ms = 100;
  int reconnect_ivl_max_ms = 5000;
  // The same for each socket of a DEALER to several endpoints (a
  // coordinator and its standbys); 0: no backoff, a dial every
  // reconnect_ivl (plus up to as much again of jitter). A standby binds its
  // address only once it holds the lease, so its nodes have dialled it in
  // vain since they started: backed off to reconnect_ivl_max, they would
  // find the new leader up to that long after it listens.
  int group_reconnect_ivl_max_ms = 0;
  // A DEALER whose connection was shut before its handshake ended (the
  // listener's handshake gate was full: net/redial_backoff.hpp) dials again
  // after reconnect_ivl, doubling with each such close up to this, with
  // jitter; libzmq's own backoff starts over at every TCP connection.
  int shed_redial_max_ms = 5000;
  // TCP keepalive, so that a vanished machine's connection is eventually
  // torn down by the kernel (heartbeats above are faster; this is hygiene).
  int tcp_keepalive_idle_s = 30;
  int tcp_keepalive_intvl_s = 5;
  int tcp_keepalive_cnt = 3;
  // ZMTP heartbeats: ZeroMQ closes (and a DEALER re-dials) a connection
  // whose peer stops answering. 0 turns them off.
  int zmtp_heartbeat_ivl_ms = 1000;
  int zmtp_heartbeat_timeout_ms = 5000;
  // Frames whose job_id differs from this (when both are set) are dropped.
  // May be changed later with set_job_id().
  std::string job_id;
  // With a job key every link is CURVE (docs/security.md): ROUTERs are CURVE
  // servers whose ZAP handler admits the job's client key only; DEALERs are
  // CURVE clients that pin the job's server key, so whatever arrives on a
  // DEALER link comes from a holder of the key. Null: plain links.
  std::shared_ptr<const job_key> key;
};

// Why a ZMTP handshake failed, from libzmq's socket monitor. Strangers
// without the job's key are refused by CURVE before the ZAP handler sees
// them; these make them visible (a metric by reason, a rate-limited log
// line with the peer's address).
enum class handshake_failure : uint8_t {
  no_key,       // the mechanisms differ: one side has a job key, the other none
  unknown_key,  // a CURVE key that is not the job's (another server key, or a client key ZAP refuses)
  bad_frame,    // no valid handshake: garbage, an oversized frame, a connection dropped or timed out mid-way
  busy,         // shut down as it was accepted: max_pending_handshakes others were in their handshake (a flood?)
  count_,
};
constexpr std::size_t handshake_failure_count = static_cast<std::size_t>(handshake_failure::count_);
// Stable lower-case names, the Prometheus `reason` label.
const char* to_string(handshake_failure f) noexcept;

// A snapshot of the bridge's counters.
struct zmq_bridge_stats {
  uint64_t received = 0;  // valid envelopes handed to the handler
  uint64_t sent = 0;      // envelopes handed to ZeroMQ
  std::array<uint64_t, wire::drop_kind_count> dropped{};
  std::array<uint64_t, handshake_failure_count> handshake_failures{};  // every link's
  uint64_t handshakes_succeeded = 0;
  uint64_t handshakes_in_progress = 0;  // ROUTER connections accepted, handshake not yet over
  uint64_t handshakes_shed = 0;         // shut down as accepted (handshake_failure::busy)

  uint64_t dropped_of(wire::drop_kind kind) const { return dropped[static_cast<std::size_t>(kind)]; }
  uint64_t dropped_total() const;
};

class zmq_bridge {
 public:
  // Called on the bridge thread for every valid envelope. It must not block
  // and must not call add_router/add_dealer (it may call send()).
  // `peer` is the sender's routing id on ROUTER links, empty on DEALER links.
  using inbound_handler =
      std::function<void(const std::string& link, const std::string& peer, pb::envelope env)>;
  // Called on the bridge thread for every frame dropped there (inbound, or
  // outbound: unroutable / high-water mark), e.g. to count it in Prometheus:
  //   [&m](auto&, auto&, wire::drop_kind k) {
  //     m.wire_dropped_frames(wire::to_string(k)).Increment(); }
  // Must not block. (A send() refused because the local queue is full is
  // returned to its caller and counted in stats(), not reported here.)
  using drop_handler =
      std::function<void(const std::string& link, const std::string& peer, wire::drop_kind kind)>;
  // Called on the bridge thread for every failed handshake on a link: on a
  // ROUTER a peer that could not authenticate (`peer_address` "ip:port" of
  // the connection, "" when unknown), on a DEALER the peer refusing us.
  // The bridge logs ROUTER failures itself (rate-limited per link and
  // reason), and DEALER failures when no handler is given. Must not block.
  using handshake_handler =
      std::function<void(const std::string& link, bool router, handshake_failure why, const std::string& peer_address)>;

  // Called on the bridge thread when the connection a ROUTER peer last
  // sent a valid envelope on closes (libzmq's monitor reports the
  // disconnect; its envelopes already received were handed over first). A
  // peer that has since sent on a newer connection is not reported. Must
  // not block.
  using closed_handler = std::function<void(const std::string& link, const std::string& peer)>;

  // Called on the bridge thread when a DEALER link's connection to
  // `endpoint` (one of its endpoints) completed its handshake: a peer
  // listens there now (on a node's link to its coordinators: a new leader,
  // or a restarted one). Must not block.
  using connected_handler = std::function<void(const std::string& link, const std::string& endpoint)>;

  // Starts the bridge thread. Links are added afterwards.
  zmq_bridge(zmq_bridge_options options, inbound_handler on_envelope,
             drop_handler on_drop = nullptr, handshake_handler on_handshake = nullptr,
             closed_handler on_closed = nullptr, connected_handler on_connected = nullptr);
  ~zmq_bridge();  // stop()
  zmq_bridge(const zmq_bridge&) = delete;
  zmq_bridge& operator=(const zmq_bridge&) = delete;

  // Binds a ROUTER socket named `link` to `endpoint` ("tcp://0.0.0.0:29400",
  // "tcp://127.0.0.1:*", "ipc:///run/x.sock"). Returns the bound endpoint
  // (the real port for a wildcard), or an error (address in use, bad
  // endpoint, duplicate name, bridge stopped). Blocks until the bridge
  // thread has done it; must not be called from the handlers.
  result<std::string> add_router(const std::string& link, const std::string& endpoint);

  // Creates a DEALER socket named `link` with ZMQ_ROUTING_ID `routing_id`
  // (how the ROUTER at the other end addresses us) and connects it to
  // `endpoint`. Connecting succeeds before the peer exists; ZeroMQ dials
  // with backoff and queues sends up to the high-water mark meanwhile.
  // "A,B,..." (a coordinator and its standbys) makes a socket per endpoint
  // under the one name, each with the same options (but for the reconnect
  // backoff: group_reconnect_ivl_max_ms): a message goes to the
  // endpoint that last delivered an envelope at the newest lease epoch
  // heard on the link, and to every endpoint whose connection is up while
  // there is none (nothing heard yet, its connection closed) and for a
  // registration; nothing is queued for an endpoint that is not connected
  // (net/dealer_group.hpp).
  // Errors: bad endpoint, empty or over-255-byte routing id, duplicate name.
  result<std::string> add_dealer(const std::string& link, const std::string& endpoint,
                                 const std::string& routing_id);

  // Closes the link's socket (pending outbound messages are discarded).
  // From a handler it takes effect after the handler returns.
  status remove_link(const std::string& link);

  // Queues `env` for `link` (to `peer` on a ROUTER link; ignored on a
  // DEALER link) and returns at once; thread-safe, never blocks on the
  // network. Errors only for what the caller can know now: unknown link,
  // unencodable envelope, one over max_message_bytes, queue full, bridge
  // stopped. Delivery failures
  // (unknown peer, peer's high-water mark) are counted and reported to the
  // drop handler, not returned.
  status send(const std::string& link, const std::string& peer, const pb::envelope& env);

  // Job id used to refuse foreign frames; thread-safe.
  void set_job_id(std::string job_id);

  zmq_bridge_stats stats() const;  // thread-safe

  // Handshakes the ZAP handler refused (0 without a key); thread-safe.
  uint64_t refused_handshakes() const;

  // Stops the thread and closes every socket. With `flush` 0, at once
  // (linger 0: unsent messages are discarded; returns within milliseconds).
  // With a flush deadline, everything send() accepted before the call is
  // handed to ZeroMQ and the call returns once it is on the wire or the
  // deadline passed (peers that are gone do not hold it up longer).
  // Idempotent; only the first call's deadline counts.
  void stop(std::chrono::milliseconds flush = std::chrono::milliseconds(0));

 private:
  struct outbound;
  struct command;
  struct link_state;

  void run();
  void post(std::unique_ptr<command> cmd);
  void wake();
  void drain_wake_fd();
  void do_sends(std::deque<outbound>& batch);
  void receive_from(link_state& link);
  void read_monitor(link_state& link);
  void read_monitor_events(link_state& link);
  void handshake_failed(link_state& link, handshake_failure why, const std::string& address);
  bool follows_epoch(link_state& link, uint64_t epoch);  // DEALER: false (dropped) for a deposed coordinator's
  void note_peer_fd(link_state& link, const std::string& peer, int fd);
  void connection_closed(link_state& link, int fd);
  void connected(link_state& link);  // DEALER: a connection's handshake succeeded
  void schedule_redial(link_state& link, bool failure_reported);  // DEALER: a connection closed
  void redial_due(std::chrono::steady_clock::time_point now);
  std::chrono::milliseconds poll_timeout(std::chrono::steady_clock::time_point now) const;
  // Counts a dropped frame and reports it to the drop handler; drop() also
  // logs it (once per kind, link and peer), count_drop() does not.
  void drop(const std::string& link, const std::string& peer, wire::drop_kind kind,
            const std::string& why);
  void count_drop(const std::string& link, const std::string& peer, wire::drop_kind kind);
  void send_to_group(link_state& link, outbound& out, zmq::message_t& payload);
  result<std::string> run_add(const std::string& link, const std::string& endpoint, bool router,
                              const std::string& routing_id);
  void open_socket(link_state& link, const std::string& endpoint, const std::string& routing_id);  // throws zmq::error_t
  status run_remove(const std::string& link);
  result<std::string> add_link(const std::string& link, const std::string& endpoint, bool router,
                               const std::string& routing_id);

  const zmq_bridge_options options_;
  const inbound_handler on_envelope_;
  const drop_handler on_drop_;
  const handshake_handler on_handshake_;
  const closed_handler on_closed_;
  const connected_handler on_connected_;

  mutable std::mutex mutex_;  // guards everything down to `stopped_`
  std::deque<outbound> queue_;
  std::deque<std::unique_ptr<command>> commands_;
  std::set<std::string> link_names_;  // links that exist (send() checks)
  std::string job_id_;
  bool stopped_ = false;

  std::atomic<bool> stop_requested_{false};
  std::atomic<int> flush_ms_{0};
  std::atomic<bool> wake_pending_{false};
  int wake_fd_ = -1;  // eventfd: written by any thread, read by the bridge thread

  std::atomic<uint64_t> received_{0};
  std::atomic<uint64_t> sent_{0};
  std::array<std::atomic<uint64_t>, wire::drop_kind_count> dropped_{};
  std::array<std::atomic<uint64_t>, handshake_failure_count> handshake_failures_{};
  std::atomic<uint64_t> handshakes_succeeded_{0};
  std::atomic<uint64_t> handshakes_in_progress_{0};

  // Bridge-thread state.
  std::unique_ptr<zmq::context_t> context_;
  std::unique_ptr<zap_handler> zap_;  // with a key; before any CURVE server binds
  std::vector<std::unique_ptr<link_state>> links_;
  std::set<std::string> logged_;  // "kind\0link\0peer" already logged once
  log_limiter log_limit_;         // and per kind at most a line a second after a burst

  std::thread thread_;
};

// A TCP port that was free a moment ago on every interface, chosen at random
// below the kernel's ephemeral range (so no connection or port-0 listener is
// given it meanwhile). Another process may still take it before you bind:
// tests and benches only; a server binds port 0 and reports what it got.
result<int> pick_free_tcp_port();

// The address a peer on this machine can connect to for a bound endpoint:
// "tcp://0.0.0.0:N" and "tcp://*:N" become "tcp://<host>:N"; anything else
// is returned unchanged.
std::string connectable_endpoint(const std::string& bound, const std::string& host = "127.0.0.1");

// A routing id as text for logs: printable ids as they are, others in hex.
std::string printable_routing_id(const std::string& id);

}  // namespace dtactor
