#include "net/handshake_gate.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <zmq.h>

#include <algorithm>
#include <utility>

namespace dtactor {

namespace {

constexpr int handshake_failed_events =
    ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;

// Descriptors followed at once; beyond it (events lost, or a flood larger
// than the descriptor limit allows) the oldest are taken as done.
constexpr std::size_t max_followed = 65536;

std::string peer_ip_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return {};
  char host[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET) ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&ss)->sin_addr, host, sizeof host);
  if (ss.ss_family == AF_INET6) ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_addr, host, sizeof host);
  return host;
}

int local_port_of(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return -1;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in*>(&ss)->sin_port);
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6*>(&ss)->sin6_port);
  return -1;
}

}  // namespace

int handshake_gate::monitored_events() {
  return ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED | handshake_failed_events;
}

handshake_gate::verdict handshake_gate::on_event(uint16_t event, uint32_t value, clock::time_point now) {
  expire(now);
  const int fd = static_cast<int>(value);
  if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
    mark_oldest_done();
    return verdict::none;
  }
  if ((event & handshake_failed_events) != 0) {
    failure_seen_ = true;
    return verdict::none;
  }
  if (event == ZMQ_EVENT_DISCONNECTED) {
    const bool failed = std::exchange(failure_seen_, false);
    auto it = pending_.find(fd);
    if (it == pending_.end()) {
      // A failure whose connection was taken as done by a success that was
      // in fact another's: that other one is the done one.
      if (failed) mark_oldest_done();
      return verdict::none;
    }
    const bool was_shed = it->second.shed;
    pending_.erase(it);
    if (was_shed) return verdict::shed_closed;
    return failed ? verdict::none : verdict::closed_in_handshake;
  }
  if (event != ZMQ_EVENT_ACCEPTED) return verdict::none;
  if (pending_.size() >= max_followed) pending_.erase(pending_.begin());
  const std::string address = peer_ip_of(fd);
  const bool over = over_limits(fd, address);
  auto& c = pending_[fd];
  c = connection{now, address, false};
  if (!over || !shut_down(fd)) return verdict::none;
  c.shed = true;
  ++shed_;
  return verdict::shed;
}

bool handshake_gate::over_limits(int fd, const std::string& address) const {
  std::size_t in_handshake = 0, from_address = 0;
  for (const auto& [other, c] : pending_) {
    if (other == fd || c.shed) continue;
    ++in_handshake;
    if (!address.empty() && c.address == address) ++from_address;
  }
  return in_handshake >= max_pending_ || from_address >= max_per_address_;
}

void handshake_gate::expire(clock::time_point now) {
  // libzmq drops a connection at its handshake limit; one second more covers
  // the monitor's lag.
  const auto done_by = limit_ + std::chrono::seconds(1);
  for (auto it = pending_.begin(); it != pending_.end();)
    it = now - it->second.accepted > done_by ? pending_.erase(it) : std::next(it);
}

void handshake_gate::mark_oldest_done() {
  auto oldest = std::min_element(pending_.begin(), pending_.end(), [](const auto& a, const auto& b) {
    if (a.second.shed != b.second.shed) return !a.second.shed;  // a shed connection never succeeds
    return a.second.accepted < b.second.accepted;
  });
  if (oldest != pending_.end() && !oldest->second.shed) pending_.erase(oldest);
}

bool handshake_gate::shut_down(int fd) const {
  // libzmq's I/O thread owns the descriptor: shutdown(), not close(), so
  // that its engine sees the connection end and cleans up as for any peer
  // that hangs up.
  if (port_ <= 0 || local_port_of(fd) != port_) return false;
  return ::shutdown(fd, SHUT_RDWR) == 0;
}

}  // namespace dtactor
