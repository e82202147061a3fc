#pragma once
// The wire protocol: every frame on every ZeroMQ link is one serialized
// pb::envelope (proto/wire.proto). This file turns envelopes into bytes and
// back, and decides which incoming frames are refused. It owns no sockets
// and holds no state; every function is thread-safe.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "dtactor/result.hpp"
#include "wire.pb.h"

namespace dtactor::wire {

// Bumped whenever a change to wire.proto changes meaning for an old peer
// (adding an optional field or a new message type does not).
constexpr uint32_t protocol_version = 1;

// The largest control message (one ZeroMQ frame) a dtactor socket takes
// (ZMQ_MAXMSGSIZE) or sends. libzmq reads a whole frame before it hands it
// to the CURVE handshake, so this is also what one connection of a stranger
// can cost before it is refused; it is kept to what the protocol needs.
// The largest envelopes are a generation plan (the coordinator's, with the
// job's config; and the one a node reports in register_node after a
// coordinator restart, without it): about 140 bytes per rank with a
// 128-character node id, plus the config (at most max_config_bytes,
// 256 KiB). Measured (tests/hardening_test.cpp, ControlMessages): a plan of
// 1,000 nodes x 8 ranks with 64-character ids and a 256 KiB config is
// about 0.9 MB, with 128-character ids about 1.4 MB; 2 MiB leaves ~40%
// headroom over the worst of them. Model state, checkpoints and data never
// cross the control plane (the store and the data plane carry them).
constexpr int64_t max_control_message_bytes = int64_t{2} << 20;

// How long a connection may take to finish its ZMTP (and CURVE) handshake
// before libzmq drops it (ZMQ_HANDSHAKE_IVL; libzmq's default is 30 s). A
// real peer needs milliseconds; a stranger's half-open or slow connection
// and whatever it sent are released after this.
constexpr int handshake_timeout_ms = 3000;

// How many connections of one listening socket may be in their handshake at
// once, and how many of them from one address (net/handshake_gate.hpp); one
// more is shut down as it is accepted. With max_control_message_bytes a
// connection, strangers hold at most 10 x 2 MiB = 20 MiB a socket before
// they authenticate, 40 MiB for a coordinator's two (the control link and
// the rendezvous store), and one address at most 8 of the 10 places: the
// ranks of an 8-GPU host meeting at the store at once all get in, and a
// flood from one address leaves 2 places to everyone else. The gate acts on
// the monitor's events, a moment after libzmq has accepted a connection and
// begun to read it; on a loaded machine that moment lets a flood's next
// connections read part of a frame before they are shed, so the limit
// leaves room under the 64 MB that a keyed coordinator may grow
// (tests/adversarial_test.py measured up to +61 MB at 12 places with 6
// busy loops beside it). A real handshake takes about a millisecond, so 10
// at once is far above what a start of thousands of nodes needs; a peer
// shed in a flood reconnects.
constexpr std::size_t max_pending_handshakes = 10;
constexpr std::size_t max_pending_handshakes_per_address = 8;

// Why a frame was refused. decode() yields the first four; the bridge adds
// the framing and delivery kinds. Values index arrays: keep `count_` last.
enum class drop_kind : uint8_t {
  garbage,           // does not parse as an envelope, or carries no body
  empty,             // a zero-length frame
  version_mismatch,  // another protocol_version
  foreign_job,       // job_id set and different from ours
  bad_multipart,     // a message with the wrong number of frames
  unroutable,        // outbound: the peer is not connected (ROUTER_MANDATORY)
  send_overflow,     // outbound: high-water mark or local queue full
  stale_epoch,       // inbound on a DEALER link: an older lease epoch than one seen there (a deposed coordinator)
  count_,
};

constexpr std::size_t drop_kind_count = static_cast<std::size_t>(drop_kind::count_);

// Stable lower-case names, used as the Prometheus `kind` label and in logs.
const char* to_string(drop_kind kind) noexcept;

// Sends libprotobuf's own log lines (e.g. "String field ... contains invalid
// UTF-8" for every such frame a stranger sends) through a per-cause rate
// limit (base/log_limiter.hpp) to stderr, instead of one line per frame.
// Call it once, early in main, before other threads start (protobuf's
// SetLogHandler is not thread-safe); later calls do nothing.
void route_protobuf_logs();

// Serializes `env`. Fails only for envelopes over 2 GiB (protobuf's limit)
// or without a body (a peer would refuse it as garbage).
result<std::string> encode(const pb::envelope& env);

// The result of decode(): an envelope, or an error together with its kind.
class decoded : public result<pb::envelope> {
 public:
  decoded(pb::envelope env) : result<pb::envelope>(std::move(env)) {}
  decoded(drop_kind kind, error e) : result<pb::envelope>(std::move(e)), kind_(kind) {}
  // Meaningful only when !ok().
  drop_kind kind() const noexcept { return kind_; }

 private:
  drop_kind kind_ = drop_kind::garbage;
};

// Parses one frame and applies the acceptance rules, in this order:
// empty -> empty; does not parse -> garbage; protocol_version differs ->
// version_mismatch (a parsed frame with neither version nor body counts as
// garbage); no body -> garbage; job_id non-empty and different from a
// non-empty `expected_job_id` -> foreign_job. An empty `expected_job_id`
// (job not known yet) accepts any job id. The error text is one line.
decoded decode(const void* data, std::size_t size, std::string_view expected_job_id);
inline decoded decode(std::string_view bytes, std::string_view expected_job_id) {
  return decode(bytes.data(), bytes.size(), expected_job_id);
}

// A random, non-zero 64-bit number that tells this process start from any
// earlier start of the same node or rank.
uint64_t new_incarnation();

// The name of the envelope's body field ("heartbeat", ...), or "none".
const char* body_name(const pb::envelope& env) noexcept;

}  // namespace dtactor::wire

namespace dtactor {

// Who sent an envelope: its `sender` field ("coordinator", "node/<node
// id>", "rank/<node id>/<local rank>") as a value. Built and parsed here
// only; the actors receive it parsed (inbound::from).
struct sender_id {
  enum class role : uint8_t { unknown, coordinator, node, rank };
  role who = role::unknown;
  std::string node;         // node and rank: the node's id
  int32_t local_rank = -1;  // rank

  static sender_id coordinator() { return {role::coordinator, {}, -1}; }
  static sender_id of_node(std::string id) { return {role::node, std::move(id), -1}; }
  static sender_id of_rank(std::string node_id, int32_t local) { return {role::rank, std::move(node_id), local}; }
  // Anything else (garbage from a peer of another version) is `unknown`,
  // with an empty node id: actors ignore what they cannot attribute.
  static sender_id parse(std::string_view s) {
    if (s == "coordinator") return coordinator();
    if (s.substr(0, 5) == "node/" && s.size() > 5) return of_node(std::string(s.substr(5)));
    if (s.substr(0, 5) == "rank/") {
      const auto rest = s.substr(5);
      const auto slash = rest.rfind('/');
      if (slash == std::string_view::npos || slash == 0 || slash + 1 == rest.size()) return {};
      int32_t local = 0;
      for (char c : rest.substr(slash + 1)) {
        if (c < '0' || c > '9' || local > 1000000) return {};
        local = local * 10 + (c - '0');
      }
      return of_rank(std::string(rest.substr(0, slash)), local);
    }
    return {};
  }
  std::string to_string() const {
    switch (who) {
      case role::coordinator: return "coordinator";
      case role::node: return "node/" + node;
      case role::rank: return "rank/" + node + "/" + std::to_string(local_rank);
      case role::unknown: break;
    }
    return "unknown";
  }
  // The node it speaks for (a rank's envelope passed on by its node names
  // the node too); its own name when it has no node.
  std::string node_name() const { return node.empty() ? to_string() : node; }
  bool operator==(const sender_id& o) const { return who == o.who && node == o.node && local_rank == o.local_rank; }
};

// Who we are on the wire: the fields every envelope a process sends carries.
struct envelope_header {
  uint32_t protocol_version = wire::protocol_version;
  std::string job_id;  // empty only before a node has learnt it
  std::string sender;  // sender_id::to_string()
  uint64_t incarnation = 0;  // wire::new_incarnation() once per process start
  uint64_t epoch = 0;        // the coordinator's lease epoch (0: none)
};

// An envelope with the header's fields and `generation` (0 = none yet) and
// no body: the caller sets exactly one (`*env.mutable_heartbeat() = hb;`).
inline pb::envelope make_envelope(const envelope_header& h, uint64_t generation) {
  pb::envelope env;
  env.set_protocol_version(h.protocol_version);
  env.set_job_id(h.job_id);
  env.set_sender(h.sender);
  env.set_incarnation(h.incarnation);
  env.set_generation(generation);
  env.set_epoch(h.epoch);
  return env;
}

}  // namespace dtactor
