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
#include "runtime/job_key.hpp"

namespace dtactor {

class rendezvous_store {
 public:
  // Listens on every interface at `port` (0: a free port, see port()).
  // `timeout`: the longest a rank's get or wait is parked for a key (ranks
  // of a generation may arrive seconds apart).
  // With `key` (docs/security.md) the store is a CURVE server whose ZAP
  // handler admits the job's client key only: a process without the key
  // cannot complete a handshake, so it reads and writes nothing.
  static result<std::unique_ptr<rendezvous_store>> start(int port, std::chrono::milliseconds timeout,
                                                         std::shared_ptr<const job_key> key = nullptr);
  // Handshakes refused for want of the job's key (0 without a key).
  uint64_t refused_handshakes() const;
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
