#pragma once
// The key-value store the ranks of every generation meet at (Gloo's
// rendezvous), hosted by the coordinator. Torch-free on purpose: the
// coordinator links no LibTorch. Ranks reach it through rendezvous_client, a
// c10d::Store (comm/rendezvous_client.hpp); the wire format is
// net/rendezvous_protocol.hpp (ZeroMQ). Keys of different generations
// never collide: each generation's group uses its own prefix
// (comm/communicator.hpp). A malformed request is logged (the first few)
// and ignored; it never stops the store.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dtactor/result.hpp"
#include "base/job_key.hpp"

namespace dtactor {

// The store's keys and parked requests, and how it answers requests, without
// the socket: the server's thread owns one, and tests and the fuzz target
// (fuzz/rendezvous_request.cpp) drive one directly. A message is a ZeroMQ
// multipart message as net/rendezvous_protocol.hpp describes it, with
// the client's routing id in front (as a ROUTER receives and sends it).
class rendezvous_table {
 public:
  using message = std::vector<std::string>;
  using time_point = std::chrono::steady_clock::time_point;
  explicit rendezvous_table(std::chrono::milliseconds timeout) : timeout_(timeout) {}
  // The replies due now: one, or none for a request that is parked or
  // malformed (counted; `why` says what was wrong, for the log).
  std::vector<message> handle(message request, time_point now, std::string* why = nullptr);
  // Answers the parked requests whose keys are all there, and times out the
  // ones past their deadline.
  std::vector<message> release(time_point now);
  uint64_t malformed() const { return malformed_; }
  size_t keys() const { return kv_.size(); }
  size_t parked() const { return waiting_.size(); }

 private:
  struct parked_request {
    std::string peer;
    std::string id;
    bool is_get = false;
    std::vector<std::string> keys;
    time_point deadline;
  };
  bool all_present(const std::vector<std::string>& keys) const;
  std::chrono::milliseconds timeout_;
  std::map<std::string, std::string> kv_;
  std::vector<parked_request> waiting_;
  uint64_t malformed_ = 0;
};

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
