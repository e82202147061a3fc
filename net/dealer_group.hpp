#pragma once
// One DEALER link to several endpoints (a coordinator and its standbys): a
// socket per endpoint, and the choice of where an outgoing message goes.
// One socket connected to all of them would deal messages round-robin over
// every connection that is up, so a leader that is stopped but keeps its
// connections open (SIGSTOP, a hung machine) would get half of them.
//
// Messages go to the member that last delivered an envelope at the newest
// lease epoch heard on the link: the leader. While there is none (nothing
// heard yet, or its connection closed), they go to every member whose
// connection is up (ZMQ_IMMEDIATE: a member with none refuses the message);
// only a leader listens, and an old one is fenced by its epoch. A
// registration always goes to every member: it is how a node finds a new
// leader while the old one is silent but still connected.
//
// Used on the bridge thread only.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace zmq {
class socket_t;
class message_t;
}  // namespace zmq

namespace dtactor {

class dealer_group {
 public:
  explicit dealer_group(std::size_t members) : members_(members), up_(members, false) {}

  std::size_t size() const { return members_; }

  // The newest lease epoch heard on the link; envelopes of an older one
  // are dropped before they reach heard().
  uint64_t epoch() const { return epoch_; }

  // `member` delivered an envelope of lease `epoch` (at least epoch()):
  // it is the leader now.
  void heard(std::size_t member, uint64_t epoch);

  // `member`'s connection closed, or a send to it would block: if it was
  // the leader, messages go to every member until a leader speaks again.
  void lost(std::size_t member);

  // `member`'s connection completed its handshake (up) or closed (down,
  // which is also lost()), as the socket monitor reports them.
  void up(std::size_t member);
  void down(std::size_t member);
  // Whether some member's connection is up. When none is (none has come up
  // yet, or every one closed), a message nobody took is no overflow: there
  // is nowhere to send it, and a node registers again as one comes up.
  bool any_up() const;

  // The member messages go to now; none: every member that takes them.
  std::optional<std::size_t> leader() const { return leader_; }

  // Hands `payload` to the leader's socket (sockets[i] is member i's), or
  // to every member's that takes it without blocking (`to_all`, or no
  // leader, or the leader's would block). Returns how many took it; 0
  // leaves `payload` untouched. Throws zmq::error_t as a send does.
  std::size_t send(const std::vector<zmq::socket_t*>& sockets, zmq::message_t& payload, bool to_all);

 private:
  std::size_t members_;
  uint64_t epoch_ = 0;
  std::optional<std::size_t> leader_;
  std::vector<bool> up_;
};

}  // namespace dtactor
