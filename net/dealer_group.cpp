#include "net/dealer_group.hpp"

#include <zmq.hpp>

namespace dtactor {

void dealer_group::heard(std::size_t member, uint64_t epoch) {
  if (member >= members_ || epoch < epoch_) return;
  epoch_ = epoch;
  leader_ = member;
}

void dealer_group::lost(std::size_t member) {
  if (leader_ == member) leader_.reset();
}

void dealer_group::up(std::size_t member) {
  if (member < members_) up_[member] = true;
}

void dealer_group::down(std::size_t member) {
  if (member < members_) up_[member] = false;
  lost(member);
}

bool dealer_group::any_up() const {
  for (bool u : up_)
    if (u) return true;
  return false;
}

std::size_t dealer_group::send(const std::vector<zmq::socket_t*>& sockets, zmq::message_t& payload, bool to_all) {
  if (leader_ && !to_all && *leader_ < sockets.size() && sockets[*leader_]) {
    if (sockets[*leader_]->send(payload, zmq::send_flags::dontwait)) return 1;
    // Its connection is gone (ZMQ_IMMEDIATE refuses a message for none) or
    // its queue is full: whoever takes it may be the new leader.
    lost(*leader_);
  }
  std::size_t taken = 0;
  for (auto* socket : sockets) {
    if (!socket) continue;
    zmq::message_t copy;
    copy.copy(payload);  // shares the bytes (reference counted)
    if (socket->send(copy, zmq::send_flags::dontwait)) ++taken;
  }
  return taken;
}

}  // namespace dtactor
