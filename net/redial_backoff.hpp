#pragma once
// When a DEALER dials again after its connection was shut before the
// handshake ended (net/handshake_gate.hpp sheds it while others are in
// their handshake): later after each such close, with jitter, and at once
// again after a handshake succeeds.
//
// libzmq's own backoff (ZMQ_RECONNECT_IVL_MAX) never grows here: it starts
// over whenever a TCP connection is made, and a shed connection was made.
// Without this, thousands of nodes started at once each redial every
// reconnect interval, and accepting and shutting their connections takes
// the CPU that the handshakes let through need (the cold start of
// thousands of nodes never ends). Pure logic: the caller reads the socket's
// monitor events, draws the jitter and keeps the time.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>

namespace dtactor {

class redial_backoff {
 public:
  using duration = std::chrono::milliseconds;

  // `first`: the delay after the first shed (at least 1 ms); it doubles
  // with every further one, up to `cap`.
  redial_backoff(duration first, duration cap) : first_(std::max(first, duration(1))), cap_(std::max(cap, first_)) {}

  // A connection's handshake succeeded: the next shed starts over.
  void on_handshake_succeeded() {
    handshaken_ = true;
    sheds_ = 0;
  }

  // A connection closed. The delay before dialling again when it closed
  // before its handshake ended, unless `failure_reported` (the peer refused
  // our key: left to libzmq's reconnects); none otherwise. `unit`, in [0, 1), draws the delay from the upper half of
  // the current step, so that nodes shed together spread out.
  std::optional<duration> on_disconnected(bool failure_reported, double unit) {
    const bool was_handshaken = handshaken_;
    handshaken_ = false;
    if (was_handshaken || failure_reported) return std::nullopt;
    duration step = first_;
    for (uint32_t i = 0; i < sheds_ && step < cap_; ++i) step *= 2;
    step = std::min(step, cap_);
    ++sheds_;
    const double u = std::clamp(unit, 0.0, 1.0);
    return duration(step.count() / 2 + static_cast<int64_t>(u * static_cast<double>(step.count() - step.count() / 2)));
  }

  uint32_t sheds() const { return sheds_; }

 private:
  duration first_, cap_;
  bool handshaken_ = false;
  uint32_t sheds_ = 0;  // since the last handshake that succeeded
};

}  // namespace dtactor
