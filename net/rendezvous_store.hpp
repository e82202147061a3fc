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
#include <optional>
#include <string>
#include <vector>

#include "dtactor/result.hpp"
#include "base/job_key.hpp"

namespace dtactor {

// What the store holds at most. Sized to what c10d's Gloo rendezvous stores
// (measured: tests/rendezvous_store_test.cpp, GlooGroupFitsTheStoreLimits):
// each rank of a group one value listing its address for every peer (about
// 136 bytes a peer, Gloo's connectFullMesh), so a group of W ranks stores
// about 136 W^2 bytes, under "g<generation>/" keys. Beyond the limits a
// write is refused with a reason (the client's call fails with it).
struct rendezvous_limits {
  std::size_t max_value_bytes = 0;  // one value
  // Keys, values and parked requests' keys, each entry counted with
  // rendezvous_entry_overhead bytes of bookkeeping besides.
  std::size_t max_total_bytes = 0;
  std::size_t max_parked = 0;  // requests waiting for keys
};
constexpr std::size_t rendezvous_entry_overhead = 64;
// Before any plan (world 0): 64 KiB a value, 8 MiB in all, 1,024 parked
// requests; each rank of the largest world planned so far adds 256 bytes to
// a value, 256 W bytes to the total (so 256 W^2 for W ranks: room for one
// Gloo group of W with ~1.9x headroom) and 8 parked requests.
rendezvous_limits rendezvous_limits_for(int64_t world);

// The store's keys and parked requests, and how it answers requests, without
// the socket: the server's thread owns one, and tests and the fuzz target
// (fuzz/rendezvous_request.cpp) drive one directly. A message is a ZeroMQ
// multipart message as net/rendezvous_protocol.hpp describes it, with
// the client's routing id in front (as a ROUTER receives and sends it).
class rendezvous_table {
 public:
  using message = std::vector<std::string>;
  using time_point = std::chrono::steady_clock::time_point;
  explicit rendezvous_table(std::chrono::milliseconds timeout, rendezvous_limits limits = rendezvous_limits_for(0))
      : timeout_(timeout), limits_(limits) {}
  // The replies due now: one, or none for a request that is parked or
  // malformed (counted; `why` says what was wrong, for the log). A write
  // over the limits is answered "err" with the reason, also in `refused`.
  // When a write does not fit, the keys of the oldest generations
  // ("g<N>/...", older than the newest one stored) make room first.
  std::vector<message> handle(message request, time_point now, std::string* why = nullptr, std::string* refused = nullptr);
  // Answers the parked requests whose keys are all there, and times out the
  // ones past their deadline.
  std::vector<message> release(time_point now);
  uint64_t malformed() const { return malformed_; }
  size_t keys() const { return kv_.size(); }
  size_t parked() const { return waiting_.size(); }
  size_t bytes() const { return bytes_; }              // as the limits count them
  size_t largest_value() const { return largest_value_; }  // ever stored
  uint64_t refused() const { return refused_; }
  void set_limits(rendezvous_limits limits) { limits_ = limits; }
  // The newest generation the coordinator planned (keys "g<N>/..."): what
  // eviction must keep. 0: none known.
  void set_planned_generation(uint64_t generation) { planned_ = generation; }
  const rendezvous_limits& limits() const { return limits_; }

 private:
  struct parked_request {
    std::string peer;
    std::string id;
    bool is_get = false;
    std::vector<std::string> keys;
    time_point deadline;
  };
  struct request;
  std::vector<message> ignore(request& r, const char* reason);
  std::vector<message> refuse(request& r, std::string reason);
  std::vector<message> park(request& r, bool is_get, std::vector<std::string> keys, time_point deadline);
  std::optional<std::vector<message>> write(request& r);
  bool all_present(const std::vector<std::string>& keys) const;
  // Room for `key` to hold `value_bytes` (evicting old generations if need
  // be); otherwise the reason it does not fit.
  std::string make_room(const std::string& key, std::size_t value_bytes);
  // Drops the keys of one generation to make room; false when none may go.
  // With a planned generation P known (set_planned_generation): the oldest
  // generation before P, else the newest beyond P + 1 (nobody planned it: a
  // stranger's keys on an open store; P + 1 may be written by ranks before
  // the store hears of its plan). P's keys never go, so an open store's
  // flood of invented generations cannot push out the running group's.
  // Without one: the oldest generation, when one newer is stored or is
  // `incoming`'s.
  bool evict_a_generation(const std::string& incoming);
  std::optional<uint64_t> generation_to_evict(const std::string& incoming) const;
  void store(const std::string& key, std::string value);
  void erase(std::map<std::string, std::string>::iterator it);
  static std::size_t parked_bytes(const parked_request& p);
  std::chrono::milliseconds timeout_;
  rendezvous_limits limits_;
  uint64_t planned_ = 0;
  std::map<std::string, std::string> kv_;
  std::vector<parked_request> waiting_;
  std::size_t bytes_ = 0;
  std::size_t largest_value_ = 0;
  uint64_t malformed_ = 0;
  uint64_t refused_ = 0;
};

class rendezvous_store {
 public:
  // Listens on `host` (an address or interface ZeroMQ binds, as in the
  // coordinator's --listen; "*" or "0.0.0.0" every interface) at `port`
  // (0: a free port, see port()).
  // `timeout`: the longest a rank's get or wait is parked for a key (ranks
  // of a generation may arrive seconds apart).
  // With `key` (docs/security.md) the store is a CURVE server whose ZAP
  // handler admits the job's client key only: a process without the key
  // cannot complete a handshake, so it reads and writes nothing.
  static result<std::unique_ptr<rendezvous_store>> start(int port, std::chrono::milliseconds timeout,
                                                         std::shared_ptr<const job_key> key = nullptr, const std::string& host = "127.0.0.1");
  // The largest world a plan has asked for so far: the limits grow to
  // rendezvous_limits_for(world) (never shrink). Thread-safe.
  void expect_world(int64_t world);
  // The newest generation planned (or adopted): eviction keeps its keys
  // (rendezvous_table::set_planned_generation). Thread-safe.
  void expect_generation(uint64_t generation);
  // Handshakes refused for want of the job's key (0 without a key).
  uint64_t refused_handshakes() const;
  // What the store holds, as of its thread's last round (thread-safe).
  struct usage_stats {
    std::size_t keys = 0, bytes = 0, largest_value = 0;
    uint64_t refused = 0;
  };
  usage_stats usage() const;
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
