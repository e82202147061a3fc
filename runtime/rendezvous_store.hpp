#pragma once
// The key-value store the ranks of every generation meet at (Gloo's
// rendezvous), hosted by the coordinator. Torch-free on purpose: the
// coordinator links no LibTorch. Ranks reach it through rendezvous_client, a
// c10d::Store (runtime/rendezvous_client.hpp); the wire format is
// runtime/rendezvous_protocol.hpp (ZeroMQ). Keys of different generations
// never collide: each generation's group uses its own prefix
// (runtime/communicator.hpp). A malformed request is logged (the first few)
// and ignored; it never stops the store.
#include <chrono>
#include <memory>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

class rendezvous_store {
 public:
  // Listens on every interface at `port` (0: a free port, see port()).
  // `timeout`: the longest a rank's get or wait is parked for a key (ranks
  // of a generation may arrive seconds apart).
  static result<std::unique_ptr<rendezvous_store>> start(int port, std::chrono::milliseconds timeout);
  // Stops serving; parked requests get no answer (their clients time out).
  ~rendezvous_store();
  int port() const;
  rendezvous_store(const rendezvous_store&) = delete;
  rendezvous_store& operator=(const rendezvous_store&) = delete;

 private:
  struct impl;
  explicit rendezvous_store(std::unique_ptr<impl> im);
  std::unique_ptr<impl> im_;
};

}  // namespace dtactor
