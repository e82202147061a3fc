#pragma once
// Who coordinates a job: one coordinator holds the job's leader lease, with
// an epoch that grows at every takeover; a standby coordinator takes the
// lease over when its holder stops renewing it. The epoch is the fencing
// token a holder stamps on its decisions, so that nodes and ranks can
// refuse an older coordinator's.
//
// Where the lease lives, and what it relies on:
//   etcd://HOST:PORT[/PREFIX]  a real etcd (v3, its JSON gateway): a lease
//       with a TTL and a leader key created only where absent (a
//       transaction on its create revision), as Kubernetes' and
//       TorchElastic's etcd elections do; the epoch is the key's create
//       revision, which etcd never hands out twice. etcd expires the lease.
//   a directory (a shared file system)  epoch-N files created with O_EXCL
//       (one creator wins), and a heartbeat file the holder replaces
//       (rename) at every renewal. A standby that sees the heartbeat
//       unchanged for the TTL, on its own clock, takes epoch N+1; the old
//       holder finds epoch N+1 at its next renewal and is deposed. A
//       holder that was itself silent for the TTL takes epoch N+1 the
//       same way (reclaim), so at most one of it and a standby leads on.
//   s3://BUCKET/PREFIX  the same files as objects: epoch-N created with
//       a conditional write (If-None-Match: *, which the server refuses
//       for an object that exists), the heartbeat replaced by a PUT. S3's
//       reads and lists are strongly consistent. A server that ignores
//       the condition is refused in one line when the lease is opened (a
//       probe object created twice).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dtactor/result.hpp"

namespace dtactor {

struct lease_holder {
  uint64_t epoch = 0;   // 0: nobody has held the lease yet
  std::string holder;   // the coordinator's id
  std::string address;  // where nodes reach it (tcp://HOST:PORT)
};

struct lease_claim {
  bool taken = false;    // ours now, at current.epoch
  lease_holder current;  // taken: us; else who holds it
};

enum class renewal { renewed, deposed };

class leader_lease {
 public:
  virtual ~leader_lease() = default;
  // One try to take the lease for `me` (its epoch is ignored): taken when
  // nobody holds it, or its holder let it lapse (no renewal for the TTL)
  // or released it; else who holds it. A standby calls it again about
  // every third of the TTL.
  virtual result<lease_claim> try_acquire(const lease_holder& me) = 0;
  // The holder renews at least every third of the TTL; deposed once
  // another holds a newer epoch: the caller stops deciding at once.
  virtual result<renewal> renew() = 0;
  // For a holder whose own renewals lapsed (its process stopped, or a
  // renewal that finished after the TTL): a standby may have taken the
  // lease meanwhile. Takes it back when nobody else held it since, at an
  // epoch nobody else holds or held (a directory or S3: epoch N+1, created
  // only where absent, so a standby racing for it loses or wins whole;
  // etcd: the same epoch while the server kept the lease alive); nullopt
  // (deposed) when another holds or held a newer epoch.
  virtual result<std::optional<uint64_t>> reclaim() = 0;
  // Who holds the lease now (epoch 0: nobody yet).
  virtual result<lease_holder> current() = 0;
  // Gives the lease up (a clean exit): a standby may take it at once.
  virtual status release() = 0;
};

struct lease_options {
  std::chrono::milliseconds ttl{3000};
  // The clock a directory lease measures the holder's silence on (tests
  // pass a fake one); empty: the steady clock.
  std::function<std::chrono::steady_clock::time_point()> now;
  std::chrono::milliseconds request_timeout{2000};  // etcd: one HTTP request
  std::string s3_endpoint;  // s3://: an S3-compatible server's URL; empty: AWS_ENDPOINT_URL, else AWS
};

// The lease at `where` (above); an unknown or unusable place is one line.
result<std::unique_ptr<leader_lease>> open_leader_lease(const std::string& where, lease_options o = {});
// What is wrong with `where` as a place for a lease, judged from its text
// alone (nothing is touched): one line, or empty.
std::string lease_place_problem(const std::string& where);

// The backends, for open_leader_lease and tests.
result<std::unique_ptr<leader_lease>> open_directory_lease(const std::string& dir, lease_options o);
class object_store;
// A lease in `store` (s3:// above), after the probe of its conditional writes.
result<std::unique_ptr<leader_lease>> open_store_lease(std::unique_ptr<object_store> store, lease_options o);
result<std::unique_ptr<leader_lease>> open_etcd_lease(const std::string& host_port, const std::string& prefix, lease_options o);

}  // namespace dtactor
