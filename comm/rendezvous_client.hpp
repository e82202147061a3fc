#pragma once
// A rank's side of the rendezvous store (net/rendezvous_store.hpp): a
// c10d::Store that Gloo's process group and the exchanges use, over one
// ZeroMQ DEALER socket. Behaves as c10d's TCPStore client does: get and wait
// block until the keys exist or the timeout passes (getTimeout() for get and
// the one-argument wait; 0 = kNoTimeout, wait as long as the server parks);
// every failure, a timeout included, throws rendezvous_error. Thread-safe
// (one request at a time).
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "base/job_key.hpp"

namespace dtactor {

// A failure of the rendezvous store's client: a c10::Error, which is what
// c10d's callers (Gloo's group) catch, of its own type, so that a caller
// tells the store's failures from the rest by type; its message names the
// store ("rendezvous store at tcp://HOST:PORT: ...").
class rendezvous_error : public c10::Error {
 public:
  using c10::Error::Error;
};

class rendezvous_client : public c10d::Store {
 public:
  // Connects lazily (ZeroMQ): an unreachable store shows as the first
  // operation's timeout.
  // With `key` it is a CURVE client pinning the job's server key (a store
  // without the key gets no handshake, and this client's operations time out).
  rendezvous_client(const std::string& host, int port, std::chrono::milliseconds timeout, std::shared_ptr<const job_key> key = nullptr);
  ~rendezvous_client() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected, const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

 private:
  struct impl;
  // Sends one request and returns the answer's results; throws rendezvous_error
  // on an "err" answer or when no answer comes within `timeout` (0: never
  // give up).
  std::vector<std::string> call(const std::vector<std::string>& request, std::chrono::milliseconds timeout);
  // Throws rendezvous_error "rendezvous store at ENDPOINT: what".
  [[noreturn]] void fail(const std::string& what) const;
  std::unique_ptr<impl> im_;
  std::mutex mu_;
};

}  // namespace dtactor
